/* Quantized weight formats and their host-side reference code.
 *
 * A quantized matrix W (rows = out features, cols = in features) travels
 * between the loader, `loom quantize`, checkpoint importers and the backends
 * in one canonical host layout, loom_qtensor_t. A backend repacks it on
 * upload (loom_weight_upload_quant) into whatever layout its kernels want;
 * loom_weight_t's pointers are backend-private.
 *
 * Schemes (value of element (r, c), g = c / group):
 *   INT8     q int8 (rows, cols)           w = scale[r] * q
 *   Q4       q uint8 (rows, cols/2)        w = scale[r, g] * (code - 8)
 *   Q4 + min                              w = scale[r, g] * code + min[r, g]
 *            code of column c: byte c/2 of the row, low nibble for even c,
 *            high nibble for odd c; scales and mins are (rows, cols/group)
 *   FP8      q e4m3 bytes (rows, cols)     w = scale[r] * e4m3(q)
 * Scales and mins are float32 (a symmetric Q4 scale may be negative: the
 * quantizer maps each group's value of largest magnitude to code 0). INT8
 * and FP8 have one scale per row (group = cols). */
#ifndef LOOM_QUANT_H
#define LOOM_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum loom_quant {
    LOOM_QUANT_NONE = 0,
    LOOM_QUANT_INT8,
    LOOM_QUANT_Q4,
    LOOM_QUANT_FP8,
} loom_quant_t;

#define LOOM_Q4_GROUP_DEFAULT 32

/* A quantization scheme as the user names it: "none", "int8", "fp8",
 * "q4" (group 32, symmetric), "q4:128", "q4_min", "q4_min:128". */
typedef struct loom_quant_spec {
    loom_quant_t quant;
    int group;    /* Q4: 32, 64 or 128; 0 otherwise */
    int with_min; /* Q4: scale and min per group */
} loom_quant_spec_t;

/* Parses a scheme name; 0 on anything else. */
int loom_quant_spec_parse(const char *s, loom_quant_spec_t *out);
/* Writes the canonical name ("q4_min:128") into buf; returns buf. */
const char *loom_quant_spec_name(const loom_quant_spec_t *s, char *buf, size_t cap);

/* A quantized matrix in the canonical host layout (above). When `owned`,
 * loom_qtensor_free releases q, scales and mins. */
typedef struct loom_qtensor {
    loom_quant_t quant;
    int64_t rows, cols;
    int group;     /* Q4: columns per scale; INT8/FP8: cols */
    void *q;       /* codes */
    float *scales; /* (rows, cols / group) */
    float *mins;   /* Q4 with min: (rows, cols / group); NULL otherwise */
    int owned;
} loom_qtensor_t;

/* Bytes of codes, of scales (and mins) in the canonical layout. */
size_t loom_qtensor_code_bytes(const loom_qtensor_t *t);
size_t loom_qtensor_scale_count(const loom_qtensor_t *t); /* floats in scales (and in mins) */
/* All bytes a backend reads per matmul in the canonical layout. */
size_t loom_qtensor_bytes(const loom_qtensor_t *t);

/* Checks shapes and group: cols divisible by group (and by 2 for Q4), group
 * one of the supported sizes, scales present, mins present iff asked.
 * `what` names the tensor in the error. */
loom_status_t loom_qtensor_check(const loom_qtensor_t *t, const char *what, loom_err_t *err);

/* Quantizes host float32 W (rows, cols) into a newly allocated (owned)
 * tensor: round to nearest, per-row absmax for INT8/FP8, per-group absmax
 * (symmetric, codes -8..7 as 0..15) or min/max (with min) for Q4. */
loom_status_t loom_quantize(const loom_quant_spec_t *spec, const float *w, int64_t rows,
                            int64_t cols, loom_qtensor_t *out, loom_err_t *err);
/* Rows [r0, r1) of t, dequantized into out ((r1 - r0) x cols float32). */
void loom_dequantize_rows(const loom_qtensor_t *t, int64_t r0, int64_t r1, float *out);
void loom_qtensor_free(loom_qtensor_t *t); /* safe on a zeroed tensor and twice */

/* e4m3 (finite, no infinities; 0x7f/0xff are NaN) <-> float32. */
float loom_fp8_e4m3_to_f32(uint8_t v);
uint8_t loom_f32_to_fp8_e4m3(float f); /* round to nearest even, saturating at 448 */

#endif

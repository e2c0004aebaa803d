/* FP8 (float8_e4m3fn) block-quantized weights: decoding, the scale grid's
 * check, and dequantization of whole matrices or of one TP slice. */
#include "common/fp8.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

float loom_e4m3fn_value(uint8_t code) {
    int e = (code >> 3) & 0xF, m = code & 7;
    float mag;
    if (e == 15 && m == 7)
        mag = NAN;
    else if (e == 0)
        mag = ldexpf((float)m, -9); /* subnormal: m/8 x 2^-6 */
    else
        mag = ldexpf((float)(8 + m), e - 10); /* (1 + m/8) x 2^(e-7) */
    return (code & 0x80) ? -mag : mag;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

loom_status_t loom_fp8_check_scale(const loom_st_tensor_t *w, const loom_st_tensor_t *scale, int br, int bc,
                                   loom_err_t *err) {
    if (w->dtype != LOOM_DT_F8_E4M3 || w->n_dims != 2)
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s: an fp8 weight must be a 2-D F8_E4M3 tensor",
                            w->name, w->file);
    if (!scale)
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has no '%s_scale_inv' beside it", w->name,
                            w->file, w->name);
    if (br <= 0 || bc <= 0)
        return loom_err_set(err, LOOM_ERR_FORMAT, "fp8 weight_block_size %d x %d is not positive", br, bc);
    int64_t want_r = ceil_div(w->shape[0], br), want_c = ceil_div(w->shape[1], bc);
    if (scale->n_dims != 2 || scale->shape[0] != want_r || scale->shape[1] != want_c ||
        (scale->dtype != LOOM_DT_F32 && scale->dtype != LOOM_DT_BF16 && scale->dtype != LOOM_DT_F16)) {
        char shape[64] = "";
        size_t n = 0;
        for (int d = 0; d < scale->n_dims && n + 24 < sizeof shape; d++)
            n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld", d ? ", " : "", (long long)scale->shape[d]);
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "tensor '%s' in %s is %s [%s]; the %lld x %lld weight '%s' in %d x %d blocks needs a "
                            "float [%lld, %lld]",
                            scale->name, scale->file, loom_dtype_name(scale->dtype), shape,
                            (long long)w->shape[0], (long long)w->shape[1], w->name, br, bc, (long long)want_r,
                            (long long)want_c);
    }
    return LOOM_OK;
}

void loom_fp8_block_dequant(const uint8_t *codes, int64_t rows, int64_t cols, const float *scale_inv, int br,
                            int bc, float *out) {
    int64_t sc = ceil_div(cols, bc);
    float table[256];
    for (int k = 0; k < 256; k++) table[k] = loom_e4m3fn_value((uint8_t)k);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            out[i * cols + j] = table[codes[i * cols + j]] * scale_inv[(i / br) * sc + j / bc];
}

loom_status_t loom_st_read_fp8(loom_st_t *st, const loom_st_tensor_t *w, const loom_st_tensor_t *scale, int br,
                               int bc, int64_t row0, int64_t nrows, int64_t col0, int64_t ncols, float *dst,
                               loom_err_t *err) {
    LOOM_CHECK(loom_fp8_check_scale(w, scale, br, bc, err));
    if (nrows <= 0 || ncols <= 0) return LOOM_OK;
    /* the scale rows and columns this block touches */
    int64_t s_r0 = row0 / br, s_r1 = (row0 + nrows - 1) / br, s_c0 = col0 / bc, s_c1 = (col0 + ncols - 1) / bc;
    int64_t snr = s_r1 - s_r0 + 1, snc = s_c1 - s_c0 + 1;
    uint8_t *codes = loom_xmalloc((size_t)(nrows * ncols));
    float *s = loom_xmalloc((size_t)(snr * snc) * sizeof *s);
    loom_status_t rc = loom_st_read_raw(st, w, row0, nrows, col0, ncols, codes, err);
    if (rc == LOOM_OK) rc = loom_st_read_f32(st, scale, s_r0, snr, s_c0, snc, s, err);
    if (rc == LOOM_OK) {
        float table[256];
        for (int k = 0; k < 256; k++) table[k] = loom_e4m3fn_value((uint8_t)k);
        for (int64_t i = 0; i < nrows; i++) {
            const float *srow = s + ((row0 + i) / br - s_r0) * snc;
            for (int64_t j = 0; j < ncols; j++)
                dst[i * ncols + j] = table[codes[i * ncols + j]] * srow[(col0 + j) / bc - s_c0];
        }
    }
    free(codes);
    free(s);
    return rc;
}

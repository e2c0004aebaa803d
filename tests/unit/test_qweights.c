/* The loader's quantized-weight pieces (worker/qweights.c): a TP column
 * slice dequantizes to the same columns of the whole matrix, for per-row and
 * group schemes on odd row counts; stacked parts dequantize to the stacked
 * rows; parts of different schemes are refused naming the weight. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/quant.h"
#include "tests/test.h"
#include "worker/qweights.h"

static float *random_matrix(int64_t rows, int64_t cols, unsigned seed) {
    float *w = loom_xmalloc((size_t)(rows * cols) * sizeof(float));
    srand(seed);
    for (int64_t i = 0; i < rows * cols; i++) w[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    return w;
}

static void test_slice_cols(void) {
    const char *schemes[] = {"int8", "fp8", "q4", "q4_min", "q4:64", "q4_min:32"};
    const int64_t rows = 7, cols = 256;
    for (size_t k = 0; k < LOOM_ARRAY_LEN(schemes); k++) {
        loom_quant_spec_t spec;
        REQUIRE(loom_quant_spec_parse(schemes[k], &spec));
        float *w = random_matrix(rows, cols, 5);
        loom_qtensor_t full, part;
        REQUIRE(loom_quantize(&spec, w, rows, cols, &full, NULL) == LOOM_OK);
        int64_t c0 = 64, nc = 128;
        loom_qw_slice_cols(&full, c0, nc, &part);
        CHECK(part.rows == rows && part.cols == nc);
        CHECK(loom_qtensor_check(&part, "slice", NULL) == LOOM_OK);
        float *a = loom_xmalloc((size_t)(rows * cols) * sizeof(float)), *b = loom_xmalloc((size_t)(rows * nc) * sizeof(float));
        loom_dequantize_rows(&full, 0, rows, a);
        loom_dequantize_rows(&part, 0, rows, b);
        int bad = 0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < nc; c++) bad += a[r * cols + c0 + c] != b[r * nc + c];
        CHECKF(bad == 0, "%s: %d sliced values differ from the whole matrix's", schemes[k], bad);
        free(a);
        free(b);
        free(w);
        loom_qtensor_free(&full);
        loom_qtensor_free(&part);
    }
}

static void test_stack_rows(void) {
    loom_quant_spec_t q4, i8;
    REQUIRE(loom_quant_spec_parse("q4_min", &q4) && loom_quant_spec_parse("int8", &i8));
    const int64_t cols = 64, r1 = 5, r2 = 3;
    float *w = random_matrix(r1 + r2, cols, 9);
    loom_qtensor_t parts[2], whole, stacked;
    REQUIRE(loom_quantize(&q4, w, r1, cols, &parts[0], NULL) == LOOM_OK);
    REQUIRE(loom_quantize(&q4, w + r1 * cols, r2, cols, &parts[1], NULL) == LOOM_OK);
    REQUIRE(loom_quantize(&q4, w, r1 + r2, cols, &whole, NULL) == LOOM_OK);
    REQUIRE(loom_qw_stack_rows(parts, 2, "qkv", &stacked, NULL) == LOOM_OK);
    CHECK(stacked.rows == r1 + r2 && stacked.mins != NULL);
    /* rows are quantized independently: stacking parts equals quantizing the stack */
    CHECK(!memcmp(stacked.q, whole.q, loom_qtensor_code_bytes(&whole)));
    CHECK(!memcmp(stacked.scales, whole.scales, loom_qtensor_scale_count(&whole) * sizeof(float)));
    CHECK(!memcmp(stacked.mins, whole.mins, loom_qtensor_scale_count(&whole) * sizeof(float)));
    loom_qtensor_free(&stacked);
    loom_qtensor_free(&parts[1]);
    REQUIRE(loom_quantize(&i8, w + r1 * cols, r2, cols, &parts[1], NULL) == LOOM_OK);
    loom_err_t err = {0};
    CHECK(loom_qw_stack_rows(parts, 2, "model.layers.3.self_attn.qkv", &stacked, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "model.layers.3.self_attn.qkv") != NULL, "message: %s", err.msg);
    loom_qtensor_free(&parts[0]);
    loom_qtensor_free(&parts[1]);
    loom_qtensor_free(&whole);
    free(w);
}

int main(void) {
    RUN(test_slice_cols);
    RUN(test_stack_rows);
    return test_summary();
}

/* common/weights_check.h: a finite weight that a load-time factor makes
 * Inf (3e38 x 2, 1 + 3.4e38) is refused naming the tensor, the element and
 * the transform; ordinary values pass. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "common/weights_check.h"
#include "tests/test.h"

static void test_scaled(void) {
    float w[4] = {0.5f, -1.0f, 3e38f, 2.0f};
    loom_err_t err = {0};
    CHECK(loom_weights_check_scaled("model.norm.weight", "a scale", w, 2, 2.0f, 0.0f, &err) == LOOM_OK);
    CHECK(loom_weights_check_scaled("model.norm.weight", "a scale", w, 4, 1.0f, 0.0f, &err) == LOOM_OK);
    CHECK(loom_weights_check_scaled("layers.0.q_proj.weight", "the rotary factor", w, 4, 2.0f, 0.0f, &err) ==
          LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "layers.0.q_proj.weight") && strstr(err.msg, "element 2") &&
               strstr(err.msg, "the rotary factor") && strstr(err.msg, "Inf"),
           "message: %s", err.msg);
    float big[1] = {FLT_MAX};
    CHECK(loom_weights_check_scaled("model.norm.weight", "the Gemma norm's 1 + w", big, 1, 1.0f, FLT_MAX, &err) ==
          LOOM_ERR_FORMAT);
    CHECK(strstr(err.msg, "1 + w") != NULL);
    CHECK(loom_weights_check_scaled("t", "x", w, 1, INFINITY, 0.0f, &err) == LOOM_ERR_FORMAT);
    CHECK(loom_weights_check_scaled("t", "x", w, 1, 1.0f, NAN, &err) == LOOM_ERR_FORMAT);
}

static void test_finite(void) {
    float w[3] = {1.0f, 2.0f, 3.0f};
    loom_err_t err = {0};
    CHECK(loom_weights_check_finite("t", "dequantization", w, 3, &err) == LOOM_OK);
    w[1] = w[1] * 3e38f * 1e10f; /* Inf */
    CHECK(loom_weights_check_finite("experts.0.w1", "dequantization", w, 3, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "experts.0.w1") && strstr(err.msg, "element 1") && strstr(err.msg, "dequantization"),
           "message: %s", err.msg);
}

int main(void) {
    RUN(test_scaled);
    RUN(test_finite);
    return test_summary();
}

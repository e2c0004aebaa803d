/* A minimal test harness: checks that report file:line and keep going,
 * array comparison with a dtype-tied tolerance, and a runner.
 *
 *   static void test_x(void) { CHECK(1 + 1 == 2); }
 *   int main(void) { RUN(test_x); return test_summary(); }
 */
#ifndef LOOM_TEST_H
#define LOOM_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_test_failures;
static int g_test_checks;
static const char *g_test_name = "";

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        g_test_checks++;                                                                           \
        if (!(cond)) {                                                                             \
            g_test_failures++;                                                                     \
            fprintf(stderr, "FAIL %s (%s:%d): %s\n", g_test_name, __FILE__, __LINE__, #cond);      \
        }                                                                                          \
    } while (0)

#define CHECKF(cond, ...)                                                                          \
    do {                                                                                           \
        g_test_checks++;                                                                           \
        if (!(cond)) {                                                                             \
            g_test_failures++;                                                                     \
            fprintf(stderr, "FAIL %s (%s:%d): %s: ", g_test_name, __FILE__, __LINE__, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

#define REQUIRE(cond)                                                                              \
    do {                                                                                           \
        g_test_checks++;                                                                           \
        if (!(cond)) {                                                                             \
            g_test_failures++;                                                                     \
            fprintf(stderr, "FAIL %s (%s:%d): %s (stopping this test)\n", g_test_name, __FILE__,   \
                    __LINE__, #cond);                                                              \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define RUN(fn)                                                                                    \
    do {                                                                                           \
        g_test_name = #fn;                                                                         \
        int before_ = g_test_failures;                                                             \
        fn();                                                                                      \
        fprintf(stderr, "%s %s\n", g_test_failures == before_ ? "ok  " : "FAIL", #fn);             \
    } while (0)

static inline int test_summary(void) {
    fprintf(stderr, "%d checks, %d failures\n", g_test_checks, g_test_failures);
    return g_test_failures ? 1 : 0;
}

/* |got - ref| <= atol + rtol * |ref| elementwise; prints the first few
 * mismatches and the worst error. Returns 1 when all are close. */
static inline int test_allclose(const char *what, const float *got, const float *ref, long n,
                                double atol, double rtol) {
    long bad = 0, worst_i = -1;
    double worst = 0;
    for (long i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        double lim = atol + rtol * fabs((double)ref[i]);
        if (!(d <= lim)) { /* NaN fails too */
            if (bad < 5)
                fprintf(stderr, "  %s[%ld]: got %.8g want %.8g (|d| %.3g > %.3g)\n", what, i,
                        (double)got[i], (double)ref[i], d, lim);
            bad++;
        }
        if (!(d <= worst)) {
            worst = d;
            worst_i = i;
        }
    }
    if (bad)
        fprintf(stderr, "  %s: %ld of %ld mismatched, worst |d| %.3g at %ld\n", what, bad, n, worst,
                worst_i);
    g_test_checks++;
    if (bad) {
        g_test_failures++;
        fprintf(stderr, "FAIL %s: %s not close\n", g_test_name, what);
    }
    return bad == 0;
}

/* Deterministic pseudo-random floats in [-scale, scale). */
static inline float test_randf(unsigned long long *state, float scale) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return scale * (2.0f * (float)((*state >> 40) & 0xffffff) / 16777216.0f - 1.0f);
}

/* Directory of the shared test models: $LOOM_MODELS_DIR or the build-time default. */
static inline const char *test_models_dir(void) {
    const char *e = getenv("LOOM_MODELS_DIR");
#ifdef LOOM_MODELS_DIR_DEFAULT
    return e ? e : LOOM_MODELS_DIR_DEFAULT;
#else
    return e ? e : "../shared/models";
#endif
}

#endif

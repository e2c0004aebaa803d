/* STREAM-style triad (see membw.h). Each thread owns one contiguous slice of
 * the three arrays and touches it first, so its pages are local. */
#include "bench/membw.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/util.h"

struct triad_slice {
    double *a;
    const double *b, *c;
    size_t n;
    int init;
};

static void *triad_main(void *p) {
    struct triad_slice *s = p;
    double *a = s->a;
    const double *b = s->b, *c = s->c;
    if (s->init) {
        double *bw = (double *)b, *cw = (double *)c;
        for (size_t i = 0; i < s->n; i++) {
            a[i] = 0.0;
            bw[i] = 1.0;
            cw[i] = 2.0;
        }
        return NULL;
    }
    const double k = 3.0;
    for (size_t i = 0; i < s->n; i++)
        a[i] = b[i] + k * c[i];
    return NULL;
}

/* Runs every slice on its own thread (the caller runs slice 0). */
static void run_slices(struct triad_slice *sl, int n_threads) {
    pthread_t th[256];
    int started = 0;
    for (int t = 1; t < n_threads; t++) {
        if (pthread_create(&th[t], NULL, triad_main, &sl[t]) != 0) break;
        started = t;
    }
    triad_main(&sl[0]);
    for (int t = started + 1; t < n_threads; t++)
        triad_main(&sl[t]); /* threads we could not start */
    for (int t = 1; t <= started; t++)
        pthread_join(th[t], NULL);
}

double loom_bench_triad_gbs_ex(int n_threads, size_t bytes_per_array, int passes) {
    if (n_threads <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = online > 0 ? (int)online : 1;
    }
    if (n_threads > 256) n_threads = 256;
    if (passes < 1) passes = 1;
    size_t n = bytes_per_array / sizeof(double);
    n = (n + 63) / 64 * 64;
    double *a = loom_aligned_alloc(n * sizeof *a), *b = loom_aligned_alloc(n * sizeof *b),
           *c = loom_aligned_alloc(n * sizeof *c);
    double best = 0.0;
    if (!a || !b || !c) goto out;
    struct triad_slice sl[256];
    size_t per = (n / (size_t)n_threads + 7) / 8 * 8;
    for (int t = 0; t < n_threads; t++) {
        size_t lo = LOOM_MIN((size_t)t * per, n), hi = LOOM_MIN(lo + per, n);
        sl[t] = (struct triad_slice){a + lo, b + lo, c + lo, hi - lo, 1};
    }
    run_slices(sl, n_threads);
    for (int t = 0; t < n_threads; t++)
        sl[t].init = 0;
    for (int p = 0; p < passes; p++) {
        uint64_t t0 = loom_now_ns();
        run_slices(sl, n_threads);
        double s = (double)(loom_now_ns() - t0) * 1e-9;
        double gbs = 3.0 * (double)n * sizeof(double) / s * 1e-9;
        if (gbs > best) best = gbs;
    }
    if (a[n / 2] != 7.0) best = 0.0; /* 1 + 3*2: also keeps the stores observable */
out:
    loom_aligned_free(a);
    loom_aligned_free(b);
    loom_aligned_free(c);
    return best;
}

double loom_bench_triad_gbs(int n_threads) {
    return loom_bench_triad_gbs_ex(n_threads, (size_t)64 << 20, 5);
}

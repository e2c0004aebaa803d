/* A latency histogram in constant space: log-linear buckets, 16 to each
 * power of two (each bucket at most 1/16 = 6.25% wide), from 1 ns to about
 * 18 minutes. Adding is a count-leading-zeros and an increment, cheap
 * enough for the reactor's hot path; quantiles are read off the counts (the
 * bucket's midpoint, so within 3.2% of the exact sample quantile). */
#ifndef LOOM_LATHIST_H
#define LOOM_LATHIST_H

#include <stdint.h>

#define LOOM_LATHIST_SUB_BITS 4
#define LOOM_LATHIST_MAX_BITS 40 /* values are clamped below 2^40 ns */
#define LOOM_LATHIST_BUCKETS                                                                       \
    ((LOOM_LATHIST_MAX_BITS - LOOM_LATHIST_SUB_BITS + 1) << LOOM_LATHIST_SUB_BITS)

typedef struct loom_lathist {
    uint64_t n, sum_ns, max_ns;
    uint64_t count[LOOM_LATHIST_BUCKETS];
} loom_lathist_t;

void loom_lathist_add(loom_lathist_t *h, uint64_t ns);
/* The q-quantile (0 < q <= 1) in nanoseconds; 0 when empty. */
double loom_lathist_quantile(const loom_lathist_t *h, double q);

#endif

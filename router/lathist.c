/* Log-linear latency histogram (lathist.h). A value v with its top set bit
 * at position e >= SUB_BITS lands in bucket ((e - SUB_BITS + 1) << SUB_BITS)
 * + the SUB_BITS bits below the top one; smaller values are their own
 * bucket. The buckets of successive powers of two are thus contiguous. */
#include "router/lathist.h"

#include <math.h>

#define SUB (1u << LOOM_LATHIST_SUB_BITS)

static int bucket_of(uint64_t v) {
    if (v < SUB) return (int)v;
    int e = 63 - __builtin_clzll(v);
    return ((e - LOOM_LATHIST_SUB_BITS + 1) << LOOM_LATHIST_SUB_BITS) +
           (int)((v >> (e - LOOM_LATHIST_SUB_BITS)) & (SUB - 1));
}

/* The bucket's lowest value and width. */
static void bucket_range(int b, double *lo, double *width) {
    if (b < (int)SUB) {
        *lo = b;
        *width = 1;
        return;
    }
    int e = (b >> LOOM_LATHIST_SUB_BITS) + LOOM_LATHIST_SUB_BITS - 1;
    int m = b & (int)(SUB - 1);
    *width = ldexp(1.0, e - LOOM_LATHIST_SUB_BITS);
    *lo = (SUB + (unsigned)m) * *width;
}

void loom_lathist_add(loom_lathist_t *h, uint64_t ns) {
    const uint64_t top = (1ull << LOOM_LATHIST_MAX_BITS) - 1;
    if (ns > top) ns = top;
    h->count[bucket_of(ns)]++;
    h->n++;
    h->sum_ns += ns;
    if (ns > h->max_ns) h->max_ns = ns;
}

double loom_lathist_quantile(const loom_lathist_t *h, double q) {
    if (!h->n) return 0;
    uint64_t rank = (uint64_t)ceil(q * (double)h->n), seen = 0;
    if (rank < 1) rank = 1;
    for (int b = 0; b < LOOM_LATHIST_BUCKETS; b++) {
        seen += h->count[b];
        if (seen >= rank) {
            double lo, w;
            bucket_range(b, &lo, &w);
            double mid = lo + (w - 1) / 2;
            return mid > (double)h->max_ns ? (double)h->max_ns : mid;
        }
    }
    return (double)h->max_ns;
}

/* A STREAM-style triad (a[i] = b[i] + s*c[i] over arrays far larger than the
 * caches) to measure the machine's DRAM bandwidth in the same run as a
 * benchmark, so kernels can report their GB/s as a fraction of it. */
#ifndef LOOM_BENCH_MEMBW_H
#define LOOM_BENCH_MEMBW_H

#include <stddef.h>

/* Best of 5 passes over 3 arrays of 64 MiB on n_threads threads (<= 0: one
 * per online core), in GB/s counting 24 bytes per element as STREAM does
 * (the write-allocate read of `a` is not counted). 0 if memory is short. */
double loom_bench_triad_gbs(int n_threads);
/* The same with the array size and number of passes chosen. */
double loom_bench_triad_gbs_ex(int n_threads, size_t bytes_per_array, int passes);

#endif

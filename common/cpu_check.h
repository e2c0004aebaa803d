/* The instruction sets this build was compiled for, checked against the CPU
 * at start-up: a binary built with -march=native or -mavx2 dies with
 * SIGILL somewhere deep on a CPU without them; this says so instead, first
 * thing in main(). LOOM_CPU_PRETEND_MISSING=avx2,fma (or "all") makes the
 * check pretend those features are absent, for tests. */
#ifndef LOOM_CPU_CHECK_H
#define LOOM_CPU_CHECK_H

#include <stddef.h>

/* The features the build requires (from the compiler's predefined macros),
 * as names separated by spaces, e.g. "sse4.2 avx avx2 fma f16c"; "" when it
 * targets the baseline ISA. Compiled with the build's own flags. */
const char *loom_cpu_build_features(void);

/* Writes into missing (n bytes) the required features this CPU lacks
 * (space separated); returns how many. */
int loom_cpu_missing_features(char *missing, size_t n);

/* Prints an error naming the missing features and exits with status 1 when
 * the CPU cannot run this build; returns otherwise. prog names the binary
 * in the message. Call first in main(). */
void loom_cpu_check_or_exit(const char *prog);

#endif

/* Helpers shared by the CPU comm backends (shm, tcp): deadlines, futex waits,
 * the rank-order sum and shared-memory names. Internal to worker/; the public
 * interface is worker/comm.h. */
#ifndef LOOM_COMM_UTIL_H
#define LOOM_COMM_UTIL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Longest wait inside one futex or poll call: waiters wake at least this often
 * to look at the abort flags, the deadline and whether the peer still lives. */
#define LOOM_COMM_SLICE_MS 50

/* CLOCK_MONOTONIC deadline timeout_ms from now; 0 means "no deadline". */
uint64_t loom_comm_deadline(int timeout_ms);
int loom_comm_expired(uint64_t deadline);
/* Milliseconds left before deadline, at most cap_ms (cap_ms when there is no
 * deadline, 0 once it has passed). Rounded up so a wait never ends early. */
int loom_comm_ms_left(uint64_t deadline, int cap_ms);

/* Sleeps while *word == val, at most timeout_ms. Uses the shared (not
 * PRIVATE) futex ops: the word may live in memory other processes map. */
void loom_comm_futex_wait(_Atomic uint32_t *word, uint32_t val, int timeout_ms);
void loom_comm_futex_wake(_Atomic uint32_t *word); /* wakes every waiter */

/* True when counter has reached target, modulo 2^32 (counters wrap). */
static inline int loom_comm_reached(uint32_t counter, uint32_t target) {
    return (int32_t)(counter - target) >= 0;
}

static inline void loom_comm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* How long a waiter spins before it sleeps: $LOOM_COMM_SPIN_US, else
 * default_ns (each backend picks its own; see comm_shm.c and comm_tcp.c). */
uint64_t loom_comm_spin_ns(uint64_t default_ns);

/* out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ...: the rank-order sum,
 * bitwise the same on every rank. out may be one of the sources. */
void loom_comm_sum_ranks(float *out, const float *const *src, int n_src, int64_t n);

/* Builds a POSIX shared-memory name "/loom-<part>-<part>...~<hash>". Bytes
 * outside [A-Za-z0-9._-] become '_' and long names are cut, so it is always a
 * valid name shorter than LOOM_COMM_SHM_NAME_MAX; the hash of the exact parts
 * at the end keeps names that read alike apart. */
#define LOOM_COMM_SHM_NAME_MAX 240
void loom_comm_shm_name(char out[LOOM_COMM_SHM_NAME_MAX + 16], const char *const *parts,
                        int n_parts);

#endif

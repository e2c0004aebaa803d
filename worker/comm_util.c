/* Helpers shared by the CPU comm backends: deadlines, futexes, the rank-order
 * sum and shared-memory names (see comm_util.h). */
#include "worker/comm_util.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/util.h"

uint64_t loom_comm_deadline(int timeout_ms) {
    if (timeout_ms <= 0) return 0;
    return loom_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

int loom_comm_expired(uint64_t deadline) {
    return deadline && loom_now_ns() >= deadline;
}

int loom_comm_ms_left(uint64_t deadline, int cap_ms) {
    if (!deadline) return cap_ms;
    uint64_t now = loom_now_ns();
    if (now >= deadline) return 0;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms < (uint64_t)cap_ms ? (int)ms : cap_ms;
}

void loom_comm_futex_wait(_Atomic uint32_t *word, uint32_t val, int timeout_ms) {
    struct timespec ts = {timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L};
    /* EAGAIN (value already changed), EINTR and ETIMEDOUT all just return:
     * the caller re-reads the word and its flags. */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, val, &ts, NULL, 0);
}

void loom_comm_futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

uint64_t loom_comm_spin_ns(uint64_t default_ns) {
    const char *e = getenv("LOOM_COMM_SPIN_US");
    if (e && *e) {
        char *end;
        long us = strtol(e, &end, 10);
        if (*end == '\0' && us >= 0 && us <= 1000000) return (uint64_t)us * 1000;
    }
    return default_ns;
}

void loom_comm_sum_ranks(float *out, const float *const *src, int n_src, int64_t n) {
    /* Block-wise so the accumulator stays in L1 and every inner loop is a
     * plain vectorisable a[i] += b[i]; each element still sums in rank order.
     * Reads of a block finish before its write, so out may alias a source. */
    enum { BLOCK = 2048 };
    float acc[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = LOOM_MIN((int64_t)BLOCK, n - b);
        memcpy(acc, src[0] + b, (size_t)m * sizeof(float));
        for (int r = 1; r < n_src; r++) {
            const float *s = src[r] + b;
            for (int64_t i = 0; i < m; i++)
                acc[i] += s[i];
        }
        memcpy(out + b, acc, (size_t)m * sizeof(float));
    }
}

static uint64_t fnv1a(uint64_t h, const char *s) {
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

void loom_comm_shm_name(char out[LOOM_COMM_SHM_NAME_MAX + 16], const char *const *parts,
                        int n_parts) {
    /* The readable part may be cut or have bytes replaced, so a hash of the
     * exact parts always follows it: different parts never share a name. */
    const size_t keep = LOOM_COMM_SHM_NAME_MAX - 18; /* room for "~" + 16 hex digits + NUL */
    uint64_t h = 14695981039346656037ull;
    size_t len = 0;
    memcpy(out, "/loom", 5);
    len = 5;
    for (int i = 0; i < n_parts; i++) {
        const char *s = parts[i] ? parts[i] : "";
        h = fnv1a(h, s);
        h = fnv1a(h, "\x1f"); /* part separator, so ("ab","c") != ("a","bc") */
        if (len < keep) out[len++] = '-';
        for (; *s && len < keep; s++) {
            unsigned char ch = (unsigned char)*s;
            int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                     (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
            out[len++] = ok ? (char)ch : '_';
        }
    }
    snprintf(out + len, LOOM_COMM_SHM_NAME_MAX + 16 - len, "~%016llx", (unsigned long long)h);
}

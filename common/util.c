/* Checked allocation, clocks, whole-file reads and float conversions. */
#include "common/util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static _Noreturn void oom(size_t n) {
    fprintf(stderr, "loom: out of memory allocating %zu bytes\n", n);
    abort();
}

void *loom_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}

void *loom_xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) oom(count * size);
    return p;
}

void *loom_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) oom(n);
    return q;
}

char *loom_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = loom_xmalloc(n);
    memcpy(d, s, n);
    return d;
}

void *loom_aligned_alloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    return p;
}

void loom_aligned_free(void *p) {
    free(p);
}

uint64_t loom_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double loom_now_s(void) {
    return (double)loom_now_ns() * 1e-9;
}

loom_status_t loom_read_file(const char *path, char **data, size_t *len, loom_err_t *err) {
    *data = NULL;
    if (len) *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return loom_err_set(err, LOOM_ERR_IO, "%s: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = loom_xmalloc(cap);
    for (;;) {
        if (n + 1 >= cap) buf = loom_xrealloc(buf, cap *= 2);
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return loom_err_set(err, LOOM_ERR_IO, "%s: read error", path);
    }
    buf[n] = '\0';
    *data = buf;
    if (len) *len = n;
    return LOOM_OK;
}

int loom_path_join(char *out, size_t n, const char *dir, const char *name) {
    int w = snprintf(out, n, "%s/%s", dir, name);
    return w >= 0 && (size_t)w < n;
}

float loom_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t loom_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float loom_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t loom_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t exp = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
    uint32_t man = u & 0x7fffffu;
    if (((u >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (uint16_t)half;
}

void loom_sbuf_add(loom_sbuf_t *b, const void *data, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        b->p = loom_xrealloc(b->p, cap);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void loom_sbuf_str(loom_sbuf_t *b, const char *s) {
    loom_sbuf_add(b, s, strlen(s));
}

void loom_sbuf_printf(loom_sbuf_t *b, const char *fmt, ...) {
    for (;;) {
        size_t room = b->cap > b->len ? b->cap - b->len : 0;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(room ? b->p + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        loom_sbuf_add(b, "", 0); /* make sure the buffer exists */
        size_t cap = b->cap;
        while (cap < b->len + (size_t)n + 1) cap *= 2;
        b->p = loom_xrealloc(b->p, cap);
        b->cap = cap;
    }
}

void loom_sbuf_consume(loom_sbuf_t *b, size_t n) {
    if (n >= b->len) {
        b->len = 0;
    } else {
        memmove(b->p, b->p + n, b->len - n);
        b->len -= n;
    }
    if (b->p) b->p[b->len] = '\0';
}

void loom_sbuf_free(loom_sbuf_t *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

int loom_secret_equal(const char *secret, size_t secret_len, const char *given, size_t given_len) {
    /* every byte of the secret is looked at; a given string of another
     * length compares against itself (masked), so no branch depends on it */
    unsigned diff = (unsigned)(secret_len != given_len);
    size_t last = given_len ? given_len - 1 : 0;
    for (size_t i = 0; i < secret_len; i++) {
        size_t in = (size_t)0 - (size_t)(i < given_len); /* all ones while i indexes given */
        unsigned char g = given_len ? (unsigned char)given[(i & in) | (last & ~in)] : 0;
        diff |= (unsigned)((unsigned char)secret[i] ^ g);
    }
    /* read through a volatile so the loop is not cut short on the first difference */
    volatile unsigned d = diff;
    return d == 0;
}

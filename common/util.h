/* Small helpers every module uses: checked allocation, clocks, files. */
#ifndef LOOM_UTIL_H
#define LOOM_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* Allocation of bookkeeping memory: aborts with a message on failure, since a
 * few hundred bytes missing means the process cannot go on anyway. Large
 * buffers (weights, KV cache) use plain malloc and return LOOM_ERR_NOMEM. */
void *loom_xmalloc(size_t n);
void *loom_xcalloc(size_t count, size_t size);
void *loom_xrealloc(void *p, size_t n);
char *loom_xstrdup(const char *s);

/* 64-byte aligned allocation (SIMD, cache lines); NULL on failure. */
void *loom_aligned_alloc(size_t n);
void loom_aligned_free(void *p);

uint64_t loom_now_ns(void); /* CLOCK_MONOTONIC */
double loom_now_s(void);

/* Reads a whole file into a NUL-terminated buffer; *len excludes the NUL. */
loom_status_t loom_read_file(const char *path, char **data, size_t *len, loom_err_t *err);

/* dir + "/" + name into out (size n); returns false if it does not fit. */
int loom_path_join(char *out, size_t n, const char *dir, const char *name);

/* Converts half-precision formats to float. */
float loom_bf16_to_f32(uint16_t h);
float loom_f16_to_f32(uint16_t h);
uint16_t loom_f32_to_bf16(float f); /* round to nearest even */
uint16_t loom_f32_to_f16(float f);

/* A growing byte string, always NUL-terminated ({0} is an empty one). */
typedef struct loom_sbuf {
    char *p;
    size_t len, cap;
} loom_sbuf_t;
void loom_sbuf_add(loom_sbuf_t *b, const void *data, size_t n);
void loom_sbuf_str(loom_sbuf_t *b, const char *s);
void loom_sbuf_printf(loom_sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void loom_sbuf_consume(loom_sbuf_t *b, size_t n); /* drops the first n bytes */
void loom_sbuf_free(loom_sbuf_t *b);

/* Compares a secret (an API key) with what a client sent, in time that
 * depends on the secret's length only: not on the content, not on how
 * long a matching prefix is, and not on the length sent. 1 when equal. */
int loom_secret_equal(const char *secret, size_t secret_len, const char *given, size_t given_len);

#define LOOM_MIN(a, b) ((a) < (b) ? (a) : (b))
#define LOOM_MAX(a, b) ((a) > (b) ? (a) : (b))
#define LOOM_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif

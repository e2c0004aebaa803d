/* Loom's one status enum and the error record that carries a message with it.
 * Negative values are failures. Errors that come from the world (bad files,
 * lost peers, full queues) are returned through these, never aborted on. */
#ifndef LOOM_STATUS_H
#define LOOM_STATUS_H

#include <stdarg.h>

typedef enum loom_status {
    LOOM_OK = 0,
    LOOM_ERR_INVALID_ARGUMENT = -1, /* bad input from a user or a file */
    LOOM_ERR_NOT_FOUND = -2,
    LOOM_ERR_RESOURCE_EXHAUSTED = -3, /* queue full, out of KV blocks */
    LOOM_ERR_UNAVAILABLE = -4,        /* peer lost, grid not ready */
    LOOM_ERR_CANCELLED = -5,
    LOOM_ERR_DEADLINE_EXCEEDED = -6,
    LOOM_ERR_UNAUTHENTICATED = -7,
    LOOM_ERR_INTERNAL = -8,
    LOOM_ERR_IO = -9,           /* open/read/mmap failed */
    LOOM_ERR_FORMAT = -10,      /* corrupt or malformed file or message */
    LOOM_ERR_NOMEM = -11,       /* out of host or device memory */
    LOOM_ERR_UNSUPPORTED = -12, /* valid, but not something Loom does */
    LOOM_ERR_PROTOCOL = -13,    /* peer speaks another protocol version */
} loom_status_t;

const char *loom_status_str(loom_status_t s);

/* An error with its message. Functions that can fail for reasons a user must
 * read take a `loom_err_t *err` (NULL allowed) and fill it. */
typedef struct loom_err {
    loom_status_t code;
    char msg[512];
} loom_err_t;

/* Sets err (when not NULL) and returns code, so `return loom_err_set(...)`. */
loom_status_t loom_err_set(loom_err_t *err, loom_status_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
loom_status_t loom_err_setv(loom_err_t *err, loom_status_t code, const char *fmt, va_list ap);
void loom_err_clear(loom_err_t *err);

/* Propagate a failing status upward (the caller has already filled err). */
#define LOOM_CHECK(expr)                                                                           \
    do {                                                                                           \
        loom_status_t loom_check_s_ = (expr);                                                      \
        if (loom_check_s_ < 0) return loom_check_s_;                                               \
    } while (0)

/* Programmer errors: a broken invariant asserts loudly with file and line. */
#define LOOM_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond)) loom_assert_fail(#cond, __FILE__, __LINE__);                                  \
    } while (0)
_Noreturn void loom_assert_fail(const char *what, const char *file, int line);

#endif

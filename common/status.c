/* Status names and the error record. */
#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *loom_status_str(loom_status_t s) {
    switch (s) {
    case LOOM_OK: return "OK";
    case LOOM_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case LOOM_ERR_NOT_FOUND: return "NOT_FOUND";
    case LOOM_ERR_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case LOOM_ERR_UNAVAILABLE: return "UNAVAILABLE";
    case LOOM_ERR_CANCELLED: return "CANCELLED";
    case LOOM_ERR_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case LOOM_ERR_UNAUTHENTICATED: return "UNAUTHENTICATED";
    case LOOM_ERR_INTERNAL: return "INTERNAL";
    case LOOM_ERR_IO: return "IO_ERROR";
    case LOOM_ERR_FORMAT: return "FORMAT_ERROR";
    case LOOM_ERR_NOMEM: return "OUT_OF_MEMORY";
    case LOOM_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case LOOM_ERR_PROTOCOL: return "PROTOCOL_ERROR";
    }
    return "UNKNOWN";
}

loom_status_t loom_err_setv(loom_err_t *err, loom_status_t code, const char *fmt, va_list ap) {
    if (err) {
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    }
    return code;
}

loom_status_t loom_err_set(loom_err_t *err, loom_status_t code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    loom_err_setv(err, code, fmt, ap);
    va_end(ap);
    return code;
}

void loom_err_clear(loom_err_t *err) {
    if (err) {
        err->code = LOOM_OK;
        err->msg[0] = '\0';
    }
}

_Noreturn void loom_assert_fail(const char *what, const char *file, int line) {
    fprintf(stderr, "loom: assertion failed: %s (%s:%d)\n", what, file, line);
    fflush(stderr);
    abort();
}

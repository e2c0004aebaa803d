/* Logging: one line per event on stderr, as text ("time level component:
 * message") or as JSON lines ({"ts", "level", "component", "msg",
 * "request_id"}). The level, the format and the component name are the
 * only process-wide settings; the request a thread is serving (its
 * X-Request-Id) is per thread. */
#ifndef LOOM_LOG_H
#define LOOM_LOG_H

#include <stddef.h>

typedef enum { LOOM_LOG_DEBUG = 0, LOOM_LOG_INFO, LOOM_LOG_WARN, LOOM_LOG_ERROR, LOOM_LOG_OFF } loom_log_level_t;
typedef enum { LOOM_LOG_TEXT = 0, LOOM_LOG_JSON } loom_log_format_t;

/* Reads LOOM_LOG_LEVEL (debug|info|warn|error|off) and LOOM_LOG_FORMAT (text|json). */
void loom_log_init(const char *component);
void loom_log_set_level(loom_log_level_t level);
loom_log_level_t loom_log_level(void);
/* "text" or "json": 0, else -1 (nothing changed). */
int loom_log_set_format_name(const char *name);
void loom_log_set_format(loom_log_format_t format);
loom_log_format_t loom_log_format(void);

/* The request this thread now works for: every line the thread logs names
 * it until it is cleared (NULL or ""). Longer ids are cut at 127 bytes. */
void loom_log_set_request(const char *request_id);

void loom_log(loom_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A line about one request, from a thread that serves many (the reactor);
 * request_id NULL or "": as loom_log. */
void loom_log_req(loom_log_level_t level, const char *request_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A whole log line for these fields, without the newline, into out (cap
 * bytes, always terminated); exposed for the unit test. */
void loom_log_format_line(char *out, size_t cap, loom_log_format_t format, const char *ts_iso,
                          loom_log_level_t level, const char *component, const char *request_id, const char *msg);

#define LOOM_DEBUG(...) loom_log(LOOM_LOG_DEBUG, __VA_ARGS__)
#define LOOM_INFO(...)  loom_log(LOOM_LOG_INFO, __VA_ARGS__)
#define LOOM_WARN(...)  loom_log(LOOM_LOG_WARN, __VA_ARGS__)
#define LOOM_ERROR(...) loom_log(LOOM_LOG_ERROR, __VA_ARGS__)

#endif

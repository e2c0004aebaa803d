/* Logging: one line per event on stderr, "time level component: message".
 * The level and the component name are the only process-wide settings. */
#ifndef LOOM_LOG_H
#define LOOM_LOG_H

typedef enum { LOOM_LOG_DEBUG = 0, LOOM_LOG_INFO, LOOM_LOG_WARN, LOOM_LOG_ERROR, LOOM_LOG_OFF } loom_log_level_t;

void loom_log_init(const char *component);      /* reads LOOM_LOG_LEVEL (debug|info|warn|error|off) */
void loom_log_set_level(loom_log_level_t level);
loom_log_level_t loom_log_level(void);
void loom_log(loom_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define LOOM_DEBUG(...) loom_log(LOOM_LOG_DEBUG, __VA_ARGS__)
#define LOOM_INFO(...)  loom_log(LOOM_LOG_INFO, __VA_ARGS__)
#define LOOM_WARN(...)  loom_log(LOOM_LOG_WARN, __VA_ARGS__)
#define LOOM_ERROR(...) loom_log(LOOM_LOG_ERROR, __VA_ARGS__)

#endif

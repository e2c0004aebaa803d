/* Logging to stderr with a timestamp and the process's component name. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static loom_log_level_t g_level = LOOM_LOG_INFO;
static char g_component[32] = "loom";

void loom_log_init(const char *component) {
    if (component) snprintf(g_component, sizeof g_component, "%s", component);
    const char *env = getenv("LOOM_LOG_LEVEL");
    if (!env) return;
    if (!strcmp(env, "debug")) g_level = LOOM_LOG_DEBUG;
    else if (!strcmp(env, "info")) g_level = LOOM_LOG_INFO;
    else if (!strcmp(env, "warn")) g_level = LOOM_LOG_WARN;
    else if (!strcmp(env, "error")) g_level = LOOM_LOG_ERROR;
    else if (!strcmp(env, "off")) g_level = LOOM_LOG_OFF;
}

void loom_log_set_level(loom_log_level_t level) {
    g_level = level;
}

loom_log_level_t loom_log_level(void) {
    return g_level;
}

void loom_log(loom_log_level_t level, const char *fmt, ...) {
    if (level < g_level) return;
    static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR", "OFF"};
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s %s: ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, names[level], g_component);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line) vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line); /* one write per line keeps lines whole across processes */
}

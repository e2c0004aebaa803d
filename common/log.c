/* Logging to stderr, as text or JSON lines, with a timestamp, the
 * process's component name and the request being served (log.h). */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static loom_log_level_t g_level = LOOM_LOG_INFO;
static loom_log_format_t g_format = LOOM_LOG_TEXT;
static char g_component[160] = "loom";
static _Thread_local char t_request[128];

void loom_log_init(const char *component) {
    if (component) snprintf(g_component, sizeof g_component, "%s", component);
    const char *fmt = getenv("LOOM_LOG_FORMAT");
    if (fmt) loom_log_set_format_name(fmt);
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

int loom_log_set_format_name(const char *name) {
    if (!name) return -1;
    if (!strcmp(name, "text")) g_format = LOOM_LOG_TEXT;
    else if (!strcmp(name, "json")) g_format = LOOM_LOG_JSON;
    else return -1;
    return 0;
}

void loom_log_set_format(loom_log_format_t format) {
    g_format = format;
}

loom_log_format_t loom_log_format(void) { return g_format; }

void loom_log_set_request(const char *request_id) {
    snprintf(t_request, sizeof t_request, "%s", request_id ? request_id : "");
}

/* Appends s to out[*o..cap) as the inside of a JSON string: quotes,
 * backslashes and control bytes escaped; bytes >= 0x80 pass (UTF-8). */
static void put_json(char *out, size_t cap, size_t *o, const char *s) {
    for (; *s && *o + 7 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[(*o)++] = '\\';
            out[(*o)++] = (char)c;
        } else if (c == '\n') {
            out[(*o)++] = '\\';
            out[(*o)++] = 'n';
        } else if (c == '\t') {
            out[(*o)++] = '\\';
            out[(*o)++] = 't';
        } else if (c < 0x20 || c == 0x7f) {
            *o += (size_t)snprintf(out + *o, cap - *o, "\\u%04x", c);
        } else {
            out[(*o)++] = (char)c;
        }
    }
    out[*o] = '\0';
}

static void put_raw(char *out, size_t cap, size_t *o, const char *s) {
    while (*s && *o + 1 < cap) out[(*o)++] = *s++;
    out[*o] = '\0';
}

void loom_log_format_line(char *out, size_t cap, loom_log_format_t format, const char *ts_iso,
                          loom_log_level_t level, const char *component, const char *request_id, const char *msg) {
    static const char *upper[] = {"DEBUG", "INFO", "WARN", "ERROR", "OFF"};
    static const char *lower[] = {"debug", "info", "warn", "error", "off"};
    size_t o = 0;
    if (cap == 0) return;
    out[0] = '\0';
    int has_rid = request_id && request_id[0];
    if (format == LOOM_LOG_JSON) {
        /* the message may be cut to fit, the closing fields never are */
        char tail[320];
        size_t t = 0;
        put_raw(tail, sizeof tail, &t, "\"");
        if (has_rid) {
            put_raw(tail, sizeof tail, &t, ",\"request_id\":\"");
            put_json(tail, sizeof tail, &t, request_id);
            put_raw(tail, sizeof tail, &t, "\"");
        }
        put_raw(tail, sizeof tail, &t, "}");
        put_raw(out, cap, &o, "{\"ts\":\"");
        put_json(out, cap, &o, ts_iso);
        put_raw(out, cap, &o, "\",\"level\":\"");
        put_raw(out, cap, &o, lower[level]);
        put_raw(out, cap, &o, "\",\"component\":\"");
        put_json(out, cap, &o, component);
        put_raw(out, cap, &o, "\",\"msg\":\"");
        size_t room = cap > t + 1 ? cap - t : 0;
        if (o < room) put_json(out, room, &o, msg);
        put_raw(out, cap, &o, tail);
        return;
    }
    /* text: the time of day only */
    const char *tod = strchr(ts_iso, 'T');
    char hms[16];
    snprintf(hms, sizeof hms, "%.12s", tod ? tod + 1 : ts_iso);
    int n = has_rid ? snprintf(out, cap, "%s %-5s %s [%s]: ", hms, upper[level], component, request_id)
                    : snprintf(out, cap, "%s %-5s %s: ", hms, upper[level], component);
    if (n < 0) return;
    o = (size_t)n < cap ? (size_t)n : cap - 1;
    put_raw(out, cap, &o, msg);
}

static void emit(loom_log_level_t level, const char *request_id, const char *fmt, va_list ap) {
    char msg[2048], line[4096], ts[96];
    vsnprintf(msg, sizeof msg, fmt, ap);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct tm tm;
    gmtime_r(&now.tv_sec, &tm);
    snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
             tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(now.tv_nsec / 1000000));
    loom_log_format_line(line, sizeof line, g_format, ts, level, g_component,
                         request_id && request_id[0] ? request_id : t_request, msg);
    fprintf(stderr, "%s\n", line); /* one write per line keeps lines whole across processes */
}

void loom_log(loom_log_level_t level, const char *fmt, ...) {
    if (level < g_level || level >= LOOM_LOG_OFF) return;
    va_list ap;
    va_start(ap, fmt);
    emit(level, NULL, fmt, ap);
    va_end(ap);
}

void loom_log_req(loom_log_level_t level, const char *request_id, const char *fmt, ...) {
    if (level < g_level || level >= LOOM_LOG_OFF) return;
    va_list ap;
    va_start(ap, fmt);
    emit(level, request_id, fmt, ap);
    va_end(ap);
}

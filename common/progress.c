/* Progress lines: a refreshed terminal line or periodic log lines. */
#include "common/progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

void loom_progress_format(char *out, size_t n, const char *what, uint64_t done, uint64_t total, double seconds,
                          int final) {
    double mb = (double)done / 1e6, rate = seconds > 0 ? mb / seconds : 0;
    if (total) {
        double pct = 100.0 * (double)done / (double)total;
        if (final) pct = 100;
        else if (pct > 99) pct = 99; /* the total is an estimate: 100% only when done */
        snprintf(out, n, "%s: %.1f of %s%.1f MB (%.0f%%), %.1f s, %.1f MB/s", what, mb, final ? "" : "~",
                 final ? mb : (double)total / 1e6, pct, seconds, rate);
    } else {
        snprintf(out, n, "%s: %.1f MB, %.1f s, %.1f MB/s", what, mb, seconds, rate);
    }
}

void loom_progress_begin(loom_progress_t *p, const char *what, uint64_t total_bytes) {
    snprintf(p->what, sizeof p->what, "%s", what);
    p->total = total_bytes;
    p->t0 = p->last = loom_now_ns();
    p->tty = isatty(STDERR_FILENO) && loom_log_format() == LOOM_LOG_TEXT && loom_log_level() <= LOOM_LOG_INFO;
    p->shown = 0;
    const char *env = getenv("LOOM_PROGRESS_PERIOD_MS");
    long ms = env && env[0] ? strtol(env, NULL, 10) : 5000;
    p->period_ns = (uint64_t)(ms > 0 ? ms : 5000) * 1000000ull;
}

static void show(loom_progress_t *p, uint64_t done, uint64_t now, int final) {
    char line[256];
    loom_progress_format(line, sizeof line, p->what, done, p->total, (double)(now - p->t0) * 1e-9, final);
    if (p->tty) {
        fprintf(stderr, "\r%s\033[K%s", line, final ? "\n" : "");
        fflush(stderr);
        p->shown = !final;
    } else {
        LOOM_INFO("%s", line);
    }
    p->last = now;
}

void loom_progress_update(loom_progress_t *p, uint64_t done_bytes) {
    uint64_t now = loom_now_ns();
    if (now - p->last >= (p->tty ? 100000000ull : p->period_ns)) show(p, done_bytes, now, 0);
}

void loom_progress_end(loom_progress_t *p, uint64_t done_bytes) { show(p, done_bytes, loom_now_ns(), 1); }

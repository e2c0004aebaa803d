/* Progress of a long step (loading a model's weights) in bytes and percent:
 * on a terminal one line refreshed in place (at most 10 times a second);
 * otherwise -- a log file, a container's stdout, JSON logs -- a log line
 * every few seconds. Both end with one final line. */
#ifndef LOOM_PROGRESS_H
#define LOOM_PROGRESS_H

#include <stddef.h>
#include <stdint.h>

typedef struct loom_progress {
    char what[96];      /* "loading layers [0, 16)" */
    uint64_t total;     /* expected bytes; 0: unknown (no percent) */
    uint64_t t0, last;  /* ns: start, last line shown */
    uint64_t period_ns; /* between log lines (non-terminal); the terminal line refreshes every 100 ms */
    int tty;            /* refreshing a terminal line */
    int shown;          /* tty: a line is on screen, not yet ended */
} loom_progress_t;

/* tty: stderr is a terminal and logs are text. LOOM_PROGRESS_PERIOD_MS sets
 * the log-line period (default 5000). */
void loom_progress_begin(loom_progress_t *p, const char *what, uint64_t total_bytes);
void loom_progress_update(loom_progress_t *p, uint64_t done_bytes);
void loom_progress_end(loom_progress_t *p, uint64_t done_bytes);

/* The text of one progress line (no newline), e.g. "loading layers [0, 16):
 * 123.4 of ~456.7 MB (27%), 1.2 s, 102.8 MB/s"; the percent is capped at 99
 * until final. Exposed for the unit test. */
void loom_progress_format(char *out, size_t n, const char *what, uint64_t done, uint64_t total, double seconds,
                          int final);

#endif

/* The router's probe listener (--probe-listen HOST:PORT): /health and /ready
 * on a socket of their own, served by their own thread, so a flood or a
 * slow client on the traffic ports cannot turn a pod's probes red. */
#ifndef LOOM_ROUTER_PROBE_H
#define LOOM_ROUTER_PROBE_H

#include <stddef.h>

#include "common/status.h"

typedef struct loom_probe loom_probe_t;

/* What the probes report, asked per request from the probe thread (so it
 * must be thread-safe): *live (the process's reactor turns), *ready (it can
 * take a request), and a line for the body. */
typedef void (*loom_probe_state_fn)(void *ctx, int *live, int *ready, char *msg, size_t cap);

/* Binds bind ("HOST:PORT"; port 0 picks one) and starts the thread.
 * GET /health: 200 while live, else 503; GET /ready: 200 while live and
 * ready, else 503; anything else 404. A connection must send its request
 * within 2 s and is closed after the answer; at most 32 are held, the
 * oldest closed to make room. */
loom_status_t loom_probe_start(const char *bind, loom_probe_state_fn state, void *ctx,
                               loom_probe_t **out, loom_err_t *err);
int loom_probe_port(const loom_probe_t *p); /* the bound port */
void loom_probe_stop(loom_probe_t **p_p);   /* joins the thread; safe on NULL and twice */

#endif

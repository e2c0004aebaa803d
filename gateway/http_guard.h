/* Deadlines for reading HTTP requests: a slow client (slow-loris: headers
 * or a body trickled a byte at a time) cannot hold a connection slot longer
 * than the header or body timeout, which libmicrohttpd's idle timeout alone
 * does not bound (every byte re-arms it).
 *
 * The gateway registers each connection's socket; a watchdog thread checks
 * the slots every GUARD_TICK_MS and shuts down the socket of one that is
 * still reading past its deadline. The connection's own thread then sees
 * the end of the stream and libmicrohttpd closes it.
 *
 * Slot states:
 *   HEADERS  from accept (or the end of the previous response on a
 *            keep-alive connection) until the headers are complete;
 *            deadline: header_timeout_ms from then
 *   BODY     from the headers until the whole body is read;
 *            deadline: body_timeout_ms from the headers
 *   SERVING  the request is answered (no deadline: generation is the
 *            coordinator's time, not the client's)
 * The slot holds its own duplicate of the socket, so a shutdown never
 * reaches a descriptor number that was closed and reused meanwhile. */
#ifndef LOOM_HTTP_GUARD_H
#define LOOM_HTTP_GUARD_H

#include <stdint.h>

typedef struct loom_http_guard loom_http_guard_t;
typedef struct loom_http_slot loom_http_slot_t;

/* Starts the watchdog; a timeout <= 0 turns that deadline off. NULL when
 * the thread cannot start. */
loom_http_guard_t *loom_http_guard_create(int header_timeout_ms, int body_timeout_ms);
/* Stops the watchdog and frees the slots left. Safe on NULL and twice. */
void loom_http_guard_destroy(loom_http_guard_t **g_p);

/* A new connection on socket fd, reading its first request's headers.
 * NULL when the socket cannot be duplicated (the connection goes unguarded). */
loom_http_slot_t *loom_http_guard_add(loom_http_guard_t *g, int fd);
/* The headers are in: the body deadline runs from now. */
void loom_http_guard_headers_done(loom_http_guard_t *g, loom_http_slot_t *s);
/* The request is read; no deadline while it is answered. */
void loom_http_guard_serving(loom_http_guard_t *g, loom_http_slot_t *s);
/* The response is done; a keep-alive connection waits for its next headers. */
void loom_http_guard_next(loom_http_guard_t *g, loom_http_slot_t *s);
/* The connection closed: frees its slot and sets *s_p to NULL. */
void loom_http_guard_remove(loom_http_guard_t *g, loom_http_slot_t **s_p);
/* Connections closed for a missed deadline so far. */
uint64_t loom_http_guard_n_closed(loom_http_guard_t *g);

#endif

/* The ZeroMQ side of the loom.v1 client API that every server of it shares
 * (coordinator/server.c, router/router.c) and the control plane's receive
 * loop (coordinator/grid.c): multipart receive and Reply sending on a ROUTER. */
#ifndef LOOM_ZAPI_H
#define LOOM_ZAPI_H

#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "common/status.h"
#include "loom/v1/api.pb-c.h"

/* Reads one multipart message without blocking; frames beyond `max` are
 * dropped (the count then equals max, which no valid message has).
 * Returns the frames read (0: none waiting); the caller closes them. */
int loom_zapi_recv_frames(void *sock, zmq_msg_t *frames, int max);

/* Sends one Reply to the peer `rid` of a ROUTER socket. Returns -1 when the
 * peer is gone (the ROUTER knows no such peer any more), else 0; other
 * send failures are logged. */
int loom_zapi_send_reply(void *sock, const void *rid, size_t rid_len, Loom__V1__Reply *r);

/* An error Reply: the status and message, with the final chunk a Generate
 * stream always ends with. Returns as loom_zapi_send_reply. */
int loom_zapi_reply_error(void *sock, const void *rid, size_t rid_len, uint64_t request_id, loom_status_t code,
                          const char *msg);
/* The same with Reply.retry_after_ms: when the client may try again. */
int loom_zapi_reply_error_retry(void *sock, const void *rid, size_t rid_len, uint64_t request_id,
                                loom_status_t code, const char *msg, uint32_t retry_after_ms);

#endif

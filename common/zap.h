/* The coordinator's ZAP handler: ZeroMQ asks it (inproc://zeromq.zap.01)
 * whether a peer that completed a CURVE handshake may connect. Each keyed
 * socket has a ZAP domain with an allow-list of public keys; a listed key is
 * admitted with its allow-list name as the connection's User-Id, anything
 * else is refused and logged with the peer's address. One thread per
 * coordinator; allow-list files are re-read when they change (key rotation
 * without a restart). */
#ifndef LOOM_ZAP_H
#define LOOM_ZAP_H

#include <stddef.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/status.h"

#define LOOM_ZAP_CONTROL "loom-control"
#define LOOM_ZAP_API     "loom-api"
#define LOOM_ZAP_EVENTS  "loom-events" /* the coordinator's --kv-events PUB */

typedef struct loom_zap loom_zap_t;

/* A handler for ZeroMQ context zctx: create, secure each socket, then start
 * it before any of those sockets binds. */
loom_status_t loom_zap_create(void *zctx, loom_zap_t **out, loom_err_t *err);
/* Makes `sock` a CURVE server with secret key `kp`, its peers checked
 * against the allow-list file `allow_path` under ZAP domain `domain`;
 * `what` names its peers in log lines ("worker", "client"). Call before the
 * socket binds. Handshake failures on it (a peer with no key or another
 * server key) are logged with the peer's address too. */
loom_status_t loom_zap_secure(loom_zap_t *z, void *sock, const char *domain, const char *what,
                              const loom_keypair_t *kp, const char *allow_path, loom_err_t *err);
/* Binds inproc://zeromq.zap.01 and starts the handler thread. */
loom_status_t loom_zap_start(loom_zap_t *z, loom_err_t *err);
void loom_zap_stop(loom_zap_t **z_p); /* safe on NULL and twice; before the context terminates */

/* Peers admitted and refused so far (all domains). */
void loom_zap_counts(loom_zap_t *z, unsigned long *admitted, unsigned long *refused);

/* The check a keyed control plane makes on every message it receives: the
 * routing id a peer chose must be the name its key has in the allow-list
 * (its ZAP User-Id), so no peer can speak as another worker. Returns 1 when
 * the message may be handled (always, when z is NULL: the plane is not
 * keyed); else logs the refusal with the peer's address and returns 0. */
int loom_zap_identity_ok(loom_zap_t *z, zmq_msg_t *msg, const void *rid, size_t rid_len);

/* The rule for a client API (the coordinator's, the router's): one bound to
 * `listen`, an address other hosts can reach, needs client keys (`keyed`)
 * unless `insecure` (--insecure-api), which is warned about loudly. `who`
 * names the server in the messages ("the client API"). */
loom_status_t loom_zap_api_rule(const char *listen, int keyed, int insecure, const char *who, loom_err_t *err);

#endif

/* The coordinator's side of CURVE: which planes are keyed, from flags and
 * environment, and the refusal of a coordinator that would serve other
 * hosts, or other local processes, without keys. See
 * docs/operations.md#security. */
#ifndef LOOM_COORD_SECURITY_H
#define LOOM_COORD_SECURITY_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/zap.h"

typedef struct loom_coord_security {
    const char *curve_secret; /* the coordinator's secret key: FILE or Z85 (else $LOOM_CURVE_SECRET) */
    const char *worker_keys;  /* allow-list of worker keys: keys the control plane (else $LOOM_WORKER_KEYS) */
    const char *client_keys;  /* allow-list of client keys: keys the client API (else $LOOM_CLIENT_KEYS) */
    int insecure_api;         /* serve a non-loopback client API without client keys */
    int insecure;             /* run the control plane without worker keys (refused without it) */
    int encrypt_data;         /* tcp data plane: encrypt every frame (Assign.data_encrypt) */
} loom_coord_security_t;

/* The rules, before anything is loaded or bound: the key flags pair up
 * (an allow-list needs the coordinator's secret and the secret an
 * allow-list); a client API other hosts can reach needs client keys or
 * insecure_api; and a control plane without worker keys needs insecure,
 * on loopback too (any local process could register as a worker and see
 * every prompt's tokens). INVALID_ARGUMENT / UNAUTHENTICATED naming the
 * fix. */
loom_status_t loom_coord_security_check(const loom_coord_security_t *cfg, const char *listen, const char *control,
                                        loom_err_t *err);

/* Sets up CURVE on the API and control sockets (before they bind) and
 * starts the ZAP handler when either is keyed. `events` is the --kv-events
 * PUB socket (NULL: none): when the client API is keyed it is keyed too,
 * with the same allow-list under its own ZAP domain (LOOM_ZAP_EVENTS), so
 * only listed clients (routers) read the prefix-cache events. *zap is the
 * handler (NULL: nothing keyed); *ctl_zap is it when the control plane is
 * keyed, for loom_zap_identity_ok. `listen` and `control` are the
 * addresses the sockets will bind, for the loopback checks. */
loom_status_t loom_coord_security_setup(const loom_coord_security_t *cfg, void *zctx, void *api, void *ctl,
                                        void *events, const char *listen, const char *control, loom_zap_t **zap,
                                        loom_zap_t **ctl_zap, loom_err_t *err);

/* A fresh data-plane secret for an epoch (the kernel's random bytes). */
void loom_coord_epoch_secret(uint8_t *out, size_t n);

#endif

/* A small etcd v3 client over the JSON gateway (libcurl + cJSON), for Loom's
 * membership: leases, put/get/delete, prefix ranges, create-if-absent, a
 * prefix watch on its own thread, and a lease keeper that holds one key alive.
 * See docs/membership.md for the key layout and how Loom uses it.
 *
 * Every call is blocking and bounded by the handle's timeout. A handle is one
 * gateway endpoint with one connection: use it from one thread at a time (the
 * watch and the keeper open their own). Errors: etcd unreachable or silent ->
 * LOOM_ERR_UNAVAILABLE naming the URL; an error reply from etcd -> its gRPC
 * code mapped to a loom status, with etcd's message; a reply that is not the
 * JSON expected -> LOOM_ERR_FORMAT; a URL that is not http(s)://host[:port]
 * -> LOOM_ERR_INVALID_ARGUMENT. */
#ifndef LOOM_ETCD_H
#define LOOM_ETCD_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct loom_etcd loom_etcd_t;

/* TLS and authentication come from the environment, read by every open:
 * LOOM_ETCD_CACERT (PEM CA bundle for an https:// URL), LOOM_ETCD_CERT and
 * LOOM_ETCD_KEY (a client certificate, for etcd --client-cert-auth),
 * LOOM_ETCD_USER with LOOM_ETCD_PASSWORD or LOOM_ETCD_PASSWORD_FILE (v3 auth:
 * a token from /v3/auth/authenticate on every request, renewed when etcd
 * says it expired). A refused certificate or password is
 * LOOM_ERR_UNAUTHENTICATED naming what was refused. The binaries' --etcd-*
 * flags set these (loom_etcd_security_env). */
typedef struct loom_etcd_security {
    const char *cacert, *cert, *key, *user, *password_file;
} loom_etcd_security_t;
/* Puts the flags that are set into the environment (they win over it). */
void loom_etcd_security_env(const loom_etcd_security_t *s);
#define LOOM_ETCD_SECURITY_OPTS(s)                                                                  \
    {"etcd-cacert", LOOM_OPT_STR, &(s).cacert, "FILE", "CA certificates (PEM) to verify an https:// etcd (or LOOM_ETCD_CACERT)", 1, 0, NULL}, \
    {"etcd-cert", LOOM_OPT_STR, &(s).cert, "FILE", "client certificate (PEM) for an etcd with --client-cert-auth (or LOOM_ETCD_CERT)", 1, 0, NULL}, \
    {"etcd-key", LOOM_OPT_STR, &(s).key, "FILE", "the client certificate's key (PEM) (or LOOM_ETCD_KEY)", 1, 0, NULL}, \
    {"etcd-user", LOOM_OPT_STR, &(s).user, "NAME", "etcd user (v3 auth); needs read-write on /loom/ (or LOOM_ETCD_USER)", 1, 0, NULL}, \
    {"etcd-password-file", LOOM_OPT_STR, &(s).password_file, "FILE", "the etcd user's password, first line of FILE (or LOOM_ETCD_PASSWORD / LOOM_ETCD_PASSWORD_FILE)", 1, 0, NULL}

/* url: "http://127.0.0.1:2379" (a trailing slash is fine). timeout_ms bounds
 * each call, connection included. Does not contact etcd. */
loom_status_t loom_etcd_open(const char *url, int timeout_ms, loom_etcd_t **out, loom_err_t *err);
void loom_etcd_close(loom_etcd_t **e_p); /* NULL-safe, nulls *e_p */
const char *loom_etcd_url(const loom_etcd_t *e);

/* Leases. etcd may grant a longer TTL than asked (its minimum depends on its
 * election timeout): *granted_ttl (NULL allowed) says what it gave.
 * keepalive returns NOT_FOUND once the lease has expired or was revoked. */
loom_status_t loom_etcd_lease_grant(loom_etcd_t *e, int ttl_s, int64_t *lease_id, int *granted_ttl,
                                    loom_err_t *err);
loom_status_t loom_etcd_lease_keepalive(loom_etcd_t *e, int64_t lease_id, int *ttl_left,
                                        loom_err_t *err);
loom_status_t loom_etcd_lease_revoke(loom_etcd_t *e, int64_t lease_id, loom_err_t *err);

/* Keys are C strings; values are bytes (len of them). lease_id 0: no lease. */
loom_status_t loom_etcd_put(loom_etcd_t *e, const char *key, const void *value, size_t len,
                            int64_t lease_id, loom_err_t *err);
/* *value is malloc'd and NUL-terminated (free it); NOT_FOUND when absent.
 * len and mod_revision may be NULL. */
loom_status_t loom_etcd_get(loom_etcd_t *e, const char *key, char **value, size_t *len,
                            int64_t *mod_revision, loom_err_t *err);
/* Succeeds whether or not the key existed. */
loom_status_t loom_etcd_delete(loom_etcd_t *e, const char *key, loom_err_t *err);
/* Creates key only if it does not exist (a txn on its create revision). When
 * it exists: LOOM_ERR_RESOURCE_EXHAUSTED, the holder's value in the message. */
loom_status_t loom_etcd_put_if_absent(loom_etcd_t *e, const char *key, const void *value,
                                      size_t len, int64_t lease_id, loom_err_t *err);

typedef struct loom_etcd_kv {
    char *key;   /* NUL-terminated */
    char *value; /* NUL-terminated after value_len bytes */
    size_t value_len;
    int64_t mod_revision;
} loom_etcd_kv_t;

/* Every key starting with prefix, in key order. *revision (NULL allowed) is
 * the store's revision at the read: watch from *revision + 1 to miss nothing. */
loom_status_t loom_etcd_range_prefix(loom_etcd_t *e, const char *prefix, loom_etcd_kv_t **kvs,
                                     int *n, int64_t *revision, loom_err_t *err);
void loom_etcd_kvs_free(loom_etcd_kv_t *kvs, int n);

/* A watch of every key under a prefix, on its own thread; events go to fn on
 * that thread, in revision order. start_revision 0: from now. start returns
 * once etcd has accepted the watch (or with the error). If the stream breaks
 * (etcd restarted, connection lost) the watch reconnects with backoff and
 * resumes from the last revision + 1. If etcd has compacted the revisions it
 * needs, fn gets one LOOM_ETCD_COMPACTED event (revision = the compaction
 * point; events before it were lost: re-read the prefix) and the watch goes
 * on from there. fn must not stop its own watch. */
typedef enum { LOOM_ETCD_PUT, LOOM_ETCD_DELETE, LOOM_ETCD_COMPACTED } loom_etcd_event_type_t;
typedef struct loom_etcd_event {
    loom_etcd_event_type_t type;
    const char *key;   /* NUL-terminated; the prefix for COMPACTED */
    const char *value; /* NUL-terminated; "" for DELETE and COMPACTED */
    size_t value_len;
    int64_t revision; /* the event's mod revision */
} loom_etcd_event_t;
typedef void (*loom_etcd_watch_fn)(void *ctx, const loom_etcd_event_t *ev);
typedef struct loom_etcd_watch loom_etcd_watch_t;

/* Takes the URL and timeout from e (e is not used afterwards). */
loom_status_t loom_etcd_watch_start(loom_etcd_t *e, const char *prefix, int64_t start_revision,
                                    loom_etcd_watch_fn fn, void *ctx, loom_etcd_watch_t **out,
                                    loom_err_t *err);
void loom_etcd_watch_stop(loom_etcd_watch_t **w_p); /* prompt; NULL-safe, nulls *w_p */

/* A lease keeper: grants a lease of ttl_s, puts key = value under it
 * (create-if-absent when exclusive), then keeps the lease alive from its own
 * thread every ttl/3. If the lease is lost (this process cut off from etcd
 * for longer than the TTL) it grants a new one and puts the key again. stop
 * revokes the lease, so the key goes at once (it waits for a call in flight,
 * at most the timeout); a process that dies loses it after the TTL. Start fails
 * (with the first call's error) when etcd cannot be reached or, exclusive,
 * the key is held by someone else. */
typedef struct loom_etcd_keeper loom_etcd_keeper_t;
loom_status_t loom_etcd_keeper_start(loom_etcd_t *e, const char *key, const void *value, size_t len,
                                     int ttl_s, int exclusive, loom_etcd_keeper_t **out,
                                     loom_err_t *err);
void loom_etcd_keeper_stop(loom_etcd_keeper_t **k_p);        /* NULL-safe, nulls *k_p */
int64_t loom_etcd_keeper_lease(const loom_etcd_keeper_t *k); /* the current lease id */

/* Standard base64 with padding, as etcd's gateway writes keys and values.
 * encode writes 4*((n+2)/3) chars plus a NUL into dst and returns the count.
 * decode accepts padded or unpadded input, writes at most 3*(n/4)+2 bytes and
 * returns LOOM_ERR_FORMAT on a character outside the alphabet or bad padding. */
size_t loom_b64_encode(const void *src, size_t n, char *dst);
loom_status_t loom_b64_decode(const char *src, size_t n, void *dst, size_t *out_len);

/* The range end that selects every key starting with prefix (its last byte
 * + 1, trailing 0xff bytes dropped; "\0" for all keys). Writes into end (size
 * at least n + 1) and returns its length. */
size_t loom_etcd_prefix_end(const char *prefix, size_t n, char *end);

#endif

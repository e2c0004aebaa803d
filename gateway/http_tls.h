/* TLS for the HTTP gateway: the certificate chain and private key files
 * (PEM) read and checked at start-up, so that a wrong file, a key that does
 * not match the certificate or an expired certificate is an error naming
 * the file instead of a gateway that fails every handshake. libmicrohttpd
 * (built with GnuTLS) then serves HTTPS from the texts. */
#ifndef LOOM_HTTP_TLS_H
#define LOOM_HTTP_TLS_H

#include "common/status.h"

typedef struct loom_http_tls {
    char *cert_pem; /* the certificate chain, leaf first */
    char *key_pem;
    long long not_after; /* the leaf's expiry (unix time) */
    char *priorities;    /* the GnuTLS priority string served (checked) */
} loom_http_tls_t;

/* The default: TLS 1.2 and 1.3 only, forward-secret key exchanges (ECDHE,
 * DHE; no static RSA) and AEAD ciphers only (no CBC, no RC4, no 3DES). */
#define LOOM_HTTP_TLS_DEFAULT_PRIORITIES                                                                      \
    "NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2:-RSA:-VERS-SSL3.0:-AES-128-CBC:-AES-256-CBC:-CAMELLIA-128-CBC:" \
    "-CAMELLIA-256-CBC:-3DES-CBC:-ARCFOUR-128"

/* Checks a GnuTLS priority string (--ssl-ciphers; NULL: the default) into
 * t->priorities: INVALID_ARGUMENT naming where it is wrong. */
loom_status_t loom_http_tls_priorities(const char *given, loom_http_tls_t *t, loom_err_t *err);

/* Reads and checks cert_path and key_path. INVALID_ARGUMENT naming the file
 * and the reason when unreadable, not PEM, mismatched, expired or not yet
 * valid. */
loom_status_t loom_http_tls_load(const char *cert_path, const char *key_path, loom_http_tls_t *out,
                                 loom_err_t *err);
void loom_http_tls_free(loom_http_tls_t *t); /* safe on a zeroed or freed struct */

#endif

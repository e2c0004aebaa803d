/* CURVE keys for the control and client planes: key pairs in Z85 text
 * (40 characters), key files, and allow-lists that name each public key.
 * See docs/operations.md#security for the formats and where keys come from. */
#ifndef LOOM_KEYS_H
#define LOOM_KEYS_H

#include <stddef.h>

#include "common/status.h"

#define LOOM_KEY_Z85 40     /* a 32-byte key in Z85 */
#define LOOM_KEY_NAME_MAX 64 /* allow-list names, NUL included */

typedef struct loom_keypair {
    char public_z85[LOOM_KEY_Z85 + 1];
    char secret_z85[LOOM_KEY_Z85 + 1];
} loom_keypair_t;

/* A fresh key pair (libzmq's CURVE key generator). */
loom_status_t loom_keys_generate(loom_keypair_t *kp, loom_err_t *err);
/* Writes DIR/NAME.pub (the public key) and DIR/NAME.key (the secret key,
 * mode 0600). Refuses to overwrite an existing secret unless force. */
loom_status_t loom_keys_write(const char *dir, const char *name, const loom_keypair_t *kp, int force,
                              loom_err_t *err);

/* A cluster's key set in dir: coordinator.key/.pub; `n_workers` worker key
 * pairs named PREFIX0, PREFIX1, ... (the workers' --id) listed in
 * workers.allow; `n_clients` client pairs client-0, ... in clients.allow
 * (written, empty, even for 0 clients when `clients_allow`). What
 * deploy/local/launch.sh and `loom keygen --cluster` make. */
loom_status_t loom_keys_make_set(const char *dir, int n_workers, const char *worker_prefix, int n_clients,
                                 int clients_allow, int force, loom_err_t *err);

/* One key from `value`: either the 40 Z85 characters themselves or the path
 * of a file holding them (blank lines and lines starting with '#' are
 * skipped). `what` names the key in error messages ("the worker's secret
 * key"). */
loom_status_t loom_key_read(const char *value, const char *what, char out[LOOM_KEY_Z85 + 1],
                            loom_err_t *err);
/* A secret key (as loom_key_read) and its public key. */
loom_status_t loom_keypair_read(const char *secret_value, const char *what, loom_keypair_t *kp,
                                loom_err_t *err);
/* `flag` when set, else the environment variable `env`, else NULL. */
const char *loom_key_source(const char *flag, const char *env);

/* Whether s is 40 valid Z85 characters that decode to a key. */
int loom_key_z85_ok(const char *s);

/* An allow-list: "NAME PUBLIC_KEY" lines ('#' comments, blank lines). */
typedef struct loom_allow {
    int n;
    struct {
        char name[LOOM_KEY_NAME_MAX];
        unsigned char key[32];
    } *e;
} loom_allow_t;

loom_status_t loom_allow_parse(const char *text, size_t len, const char *path, loom_allow_t *out,
                               loom_err_t *err);
loom_status_t loom_allow_load(const char *path, loom_allow_t *out, loom_err_t *err);
/* The name of a 32-byte public key, or NULL when it is not listed. */
const char *loom_allow_find(const loom_allow_t *a, const unsigned char key[32]);
void loom_allow_free(loom_allow_t *a);

/* Makes ZeroMQ socket `sock` a CURVE client of the server whose public key
 * is `server`, with its own secret key `secret` (each as loom_key_read;
 * NULL: $LOOM_CURVE_SERVER_KEY, $LOOM_CURVE_SECRET). With neither the
 * socket stays plain and *keyed is 0; with only one, an error names the
 * other. Call before connecting. */
loom_status_t loom_keys_client(void *sock, const char *server, const char *secret, int *keyed, loom_err_t *err);

/* Whether a ZeroMQ endpoint only reaches this host: tcp:// on 127.0.0.0/8,
 * localhost or [::1], ipc:// and inproc://. A wildcard (*, 0.0.0.0) is not. */
int loom_endpoint_is_local(const char *endpoint);

#endif

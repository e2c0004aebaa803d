/* CURVE key pairs, key files and allow-lists (common/keys.h). Keys are the
 * 32-byte Curve25519 keys of ZeroMQ's CURVE mechanism, written as Z85. */
#include "common/keys.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/util.h"

int loom_key_z85_ok(const char *s) {
    if (!s || strlen(s) != LOOM_KEY_Z85) return 0;
    uint8_t bin[32];
    return zmq_z85_decode(bin, s) != NULL;
}

loom_status_t loom_keys_generate(loom_keypair_t *kp, loom_err_t *err) {
    if (!zmq_has("curve"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "this libzmq was built without CURVE security");
    if (zmq_curve_keypair(kp->public_z85, kp->secret_z85) != 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot make a CURVE key pair: %s", zmq_strerror(errno));
    return LOOM_OK;
}

static int name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n >= LOOM_KEY_NAME_MAX) return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '-' && s[i] != '_' && s[i] != '.') return 0;
    return 1;
}

static loom_status_t write_text(const char *path, const char *text, mode_t mode, int force, loom_err_t *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | (force ? 0 : O_EXCL) | O_CLOEXEC, mode);
    if (fd < 0)
        return loom_err_set(err, LOOM_ERR_IO, "cannot write %s: %s%s", path, strerror(errno),
                            errno == EEXIST ? " (use --force to replace it)" : "");
    size_t n = strlen(text);
    ssize_t w = write(fd, text, n);
    fchmod(fd, mode);
    close(fd);
    if (w != (ssize_t)n) return loom_err_set(err, LOOM_ERR_IO, "cannot write %s", path);
    return LOOM_OK;
}

loom_status_t loom_keys_write(const char *dir, const char *name, const loom_keypair_t *kp, int force,
                              loom_err_t *err) {
    if (!name_ok(name))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "key name '%s': use 1 to %d letters, digits, '-', '_' or '.'", name,
                            LOOM_KEY_NAME_MAX - 1);
    char path[4096], text[256];
    snprintf(path, sizeof path, "%s/%s.key", dir, name);
    snprintf(text, sizeof text, "# Loom CURVE secret key '%s': keep it private\n%s\n", name, kp->secret_z85);
    LOOM_CHECK(write_text(path, text, 0600, force, err));
    snprintf(path, sizeof path, "%s/%s.pub", dir, name);
    snprintf(text, sizeof text, "# Loom CURVE public key '%s'\n%s\n", name, kp->public_z85);
    return write_text(path, text, 0644, 1, err);
}

/* The first line of text that is neither blank nor a comment, trimmed. */
static int first_line(const char *text, size_t len, char *out, size_t cap) {
    size_t i = 0;
    while (i < len) {
        size_t e = i;
        while (e < len && text[e] != '\n') e++;
        size_t a = i, b = e;
        while (a < b && isspace((unsigned char)text[a])) a++;
        while (b > a && isspace((unsigned char)text[b - 1])) b--;
        if (b > a && text[a] != '#') {
            if (b - a >= cap) return -1;
            memcpy(out, text + a, b - a);
            out[b - a] = 0;
            return 0;
        }
        i = e + 1;
    }
    return -1;
}

loom_status_t loom_key_read(const char *value, const char *what, char out[LOOM_KEY_Z85 + 1], loom_err_t *err) {
    if (!value || !value[0]) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: no key given", what);
    /* 40 characters of the Z85 alphabet ('/' and '.' among them) can also be a
     * path: an existing file wins */
    if (loom_key_z85_ok(value) && access(value, F_OK) != 0) {
        memcpy(out, value, LOOM_KEY_Z85 + 1);
        return LOOM_OK;
    }
    char *data = NULL;
    size_t len = 0;
    loom_err_t e = {0};
    if (loom_read_file(value, &data, &len, &e) < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "%s: '%s' is neither a 40-character Z85 key nor a readable key file (%s)", what, value,
                            e.msg);
    char line[128];
    int ok = first_line(data, len, line, sizeof line) == 0 && loom_key_z85_ok(line);
    free(data);
    if (!ok)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s holds no 40-character Z85 key", what, value);
    memcpy(out, line, LOOM_KEY_Z85 + 1);
    return LOOM_OK;
}

loom_status_t loom_keypair_read(const char *secret_value, const char *what, loom_keypair_t *kp, loom_err_t *err) {
    LOOM_CHECK(loom_key_read(secret_value, what, kp->secret_z85, err));
    if (zmq_curve_public(kp->public_z85, kp->secret_z85) != 0)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a CURVE secret key", what);
    return LOOM_OK;
}

const char *loom_key_source(const char *flag, const char *env) {
    if (flag && flag[0]) return flag;
    const char *v = env ? getenv(env) : NULL;
    return v && v[0] ? v : NULL;
}

loom_status_t loom_allow_parse(const char *text, size_t len, const char *path, loom_allow_t *out,
                               loom_err_t *err) {
    memset(out, 0, sizeof *out);
    int cap = 0, line_no = 0;
    size_t i = 0;
    while (i < len) {
        size_t e = i;
        while (e < len && text[e] != '\n') e++;
        line_no++;
        char line[512];
        size_t n = e - i < sizeof line - 1 ? e - i : sizeof line - 1;
        memcpy(line, text + i, n);
        line[n] = 0;
        i = e + 1;
        char *p = line;
        while (isspace((unsigned char)*p)) p++;
        if (!*p || *p == '#') continue;
        char name[LOOM_KEY_NAME_MAX + 1], key[LOOM_KEY_Z85 + 2];
        char extra[2];
        int got = sscanf(p, "%64s %41s %1s", name, key, extra);
        if (got != 2 || !name_ok(name) || !loom_key_z85_ok(key)) {
            loom_allow_free(out);
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s:%d: expected 'NAME PUBLIC_KEY' (a name of letters, digits, '-', '_', '.' and a "
                                "40-character Z85 public key)",
                                path, line_no);
        }
        uint8_t bin[32];
        zmq_z85_decode(bin, key);
        for (int k = 0; k < out->n; k++)
            if (!strcmp(out->e[k].name, name) || !memcmp(out->e[k].key, bin, 32)) {
                loom_err_set(err, LOOM_ERR_FORMAT, "%s:%d: name '%s' or its key is listed twice", path, line_no,
                             name);
                loom_allow_free(out);
                return LOOM_ERR_FORMAT;
            }
        if (out->n == cap) {
            cap = cap ? cap * 2 : 8;
            out->e = loom_xrealloc(out->e, (size_t)cap * sizeof *out->e);
        }
        snprintf(out->e[out->n].name, sizeof out->e[out->n].name, "%.63s", name);
        memcpy(out->e[out->n].key, bin, 32);
        out->n++;
    }
    return LOOM_OK;
}

loom_status_t loom_allow_load(const char *path, loom_allow_t *out, loom_err_t *err) {
    char *data = NULL;
    size_t len = 0;
    memset(out, 0, sizeof *out);
    LOOM_CHECK(loom_read_file(path, &data, &len, err));
    loom_status_t st = loom_allow_parse(data, len, path, out, err);
    free(data);
    return st;
}

const char *loom_allow_find(const loom_allow_t *a, const unsigned char key[32]) {
    for (int i = 0; a && i < a->n; i++)
        if (!memcmp(a->e[i].key, key, 32)) return a->e[i].name;
    return NULL;
}

void loom_allow_free(loom_allow_t *a) {
    if (!a) return;
    free(a->e);
    a->e = NULL;
    a->n = 0;
}

int loom_endpoint_is_local(const char *ep) {
    if (!ep) return 0;
    if (!strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9)) return 1;
    if (strncmp(ep, "tcp://", 6) != 0) return 0;
    const char *h = ep + 6;
    const char *semi = strchr(h, ';'); /* tcp://src;dst: the bound host is after ';' for connects only */
    if (semi) h = semi + 1;
    if (!strncmp(h, "127.", 4) || !strncmp(h, "localhost:", 10) || !strncmp(h, "[::1]:", 6)) return 1;
    return 0;
}

loom_status_t loom_keys_client(void *sock, const char *server, const char *secret, int *keyed, loom_err_t *err) {
    *keyed = 0;
    server = loom_key_source(server, "LOOM_CURVE_SERVER_KEY");
    secret = loom_key_source(secret, "LOOM_CURVE_SECRET");
    if (!server && !secret) return LOOM_OK;
    if (!server || !secret)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "CURVE needs both the server's public key (--curve-server-key or LOOM_CURVE_SERVER_KEY) "
                            "and this peer's secret key (--curve-secret or LOOM_CURVE_SECRET); only the %s was given",
                            server ? "server key" : "secret key");
    char skey[LOOM_KEY_Z85 + 1];
    loom_keypair_t kp;
    LOOM_CHECK(loom_key_read(server, "the server's public key (--curve-server-key)", skey, err));
    LOOM_CHECK(loom_keypair_read(secret, "this peer's secret key (--curve-secret)", &kp, err));
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, skey, LOOM_KEY_Z85) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, kp.public_z85, LOOM_KEY_Z85) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp.secret_z85, LOOM_KEY_Z85) != 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot set the CURVE keys: %s", zmq_strerror(errno));
    *keyed = 1;
    return LOOM_OK;
}

/* Makes n pairs PREFIX0.. and their allow-list file. */
static loom_status_t make_group(const char *dir, const char *prefix, int n, const char *allow_name, int force,
                                loom_err_t *err) {
    size_t cap = (size_t)n * (LOOM_KEY_NAME_MAX + LOOM_KEY_Z85 + 4) + 128, len = 0;
    char *text = loom_xmalloc(cap);
    len += (size_t)snprintf(text, cap, "# Loom %s allow-list: NAME PUBLIC_KEY\n", allow_name);
    loom_status_t st = LOOM_OK;
    for (int i = 0; i < n && st >= 0; i++) {
        char name[LOOM_KEY_NAME_MAX];
        snprintf(name, sizeof name, "%.50s%d", prefix, i);
        loom_keypair_t kp;
        st = loom_keys_generate(&kp, err);
        if (st >= 0) st = loom_keys_write(dir, name, &kp, force, err);
        if (st >= 0) len += (size_t)snprintf(text + len, cap - len, "%s %s\n", name, kp.public_z85);
    }
    if (st >= 0) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, allow_name);
        st = write_text(path, text, 0644, 1, err);
    }
    free(text);
    return st;
}

loom_status_t loom_keys_make_set(const char *dir, int n_workers, const char *worker_prefix, int n_clients,
                                 int clients_allow, int force, loom_err_t *err) {
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return loom_err_set(err, LOOM_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
    loom_keypair_t kp;
    LOOM_CHECK(loom_keys_generate(&kp, err));
    LOOM_CHECK(loom_keys_write(dir, "coordinator", &kp, force, err));
    LOOM_CHECK(make_group(dir, worker_prefix, n_workers, "workers.allow", force, err));
    if (n_clients > 0 || clients_allow) LOOM_CHECK(make_group(dir, "client-", n_clients, "clients.allow", force, err));
    return LOOM_OK;
}

/* Certificate and key loading for the HTTP gateway (http_tls.h). */
#include "gateway/http_tls.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <gnutls/gnutls.h>
#include <gnutls/x509.h>

#include "common/util.h"

#define MAX_PEM_BYTES (1 << 20)

static loom_status_t read_pem(const char *path, const char *what, char **out, loom_err_t *err) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s %s: %s", what, path,
                            strerror(errno));
    loom_sbuf_t b = {0};
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        if (b.len + n > MAX_PEM_BYTES) {
            fclose(f);
            free(b.p);
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "%s %s is over %d bytes: not a PEM file", what, path,
                                MAX_PEM_BYTES);
        }
        loom_sbuf_add(&b, buf, n);
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(b.p);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s %s: read error", what, path);
    }
    loom_sbuf_add(&b, "", 0);
    if (!b.p || !strstr(b.p, "-----BEGIN ")) {
        free(b.p);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "%s %s is not a PEM file (no -----BEGIN line)", what, path);
    }
    *out = b.p;
    return LOOM_OK;
}

loom_status_t loom_http_tls_load(const char *cert_path, const char *key_path, loom_http_tls_t *out,
                                 loom_err_t *err) {
    *out = (loom_http_tls_t){0};
    if (!cert_path || !key_path)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--tls-cert and --tls-key go together: give both");
    LOOM_CHECK(read_pem(cert_path, "--tls-cert", &out->cert_pem, err));
    loom_status_t st = read_pem(key_path, "--tls-key", &out->key_pem, err);
    if (st < 0) goto fail;

    /* the pair: GnuTLS refuses a key that does not match the certificate */
    gnutls_certificate_credentials_t cred = NULL;
    gnutls_datum_t c = {(unsigned char *)out->cert_pem, (unsigned)strlen(out->cert_pem)};
    gnutls_datum_t k = {(unsigned char *)out->key_pem, (unsigned)strlen(out->key_pem)};
    int rc = gnutls_certificate_allocate_credentials(&cred);
    if (rc >= 0)
        rc = gnutls_certificate_set_x509_key_mem2(cred, &c, &k, GNUTLS_X509_FMT_PEM, NULL, 0);
    gnutls_certificate_free_credentials(cred);
    if (rc < 0) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--tls-cert %s / --tls-key %s: %s",
                          cert_path, key_path, gnutls_strerror(rc));
        goto fail;
    }
    /* the leaf's validity */
    gnutls_x509_crt_t crt = NULL;
    rc = gnutls_x509_crt_init(&crt);
    if (rc >= 0) rc = gnutls_x509_crt_import(crt, &c, GNUTLS_X509_FMT_PEM);
    time_t not_before = rc >= 0 ? gnutls_x509_crt_get_activation_time(crt) : 0;
    time_t not_after = rc >= 0 ? gnutls_x509_crt_get_expiration_time(crt) : 0;
    gnutls_x509_crt_deinit(crt);
    if (rc < 0) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--tls-cert %s: %s", cert_path,
                          gnutls_strerror(rc));
        goto fail;
    }
    time_t now = time(NULL);
    char when[32];
    if (not_after != (time_t)-1 && not_after < now) {
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", gmtime(&not_after));
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--tls-cert %s expired on %s", cert_path,
                          when);
        goto fail;
    }
    if (not_before != (time_t)-1 && not_before > now + 300) {
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", gmtime(&not_before));
        st =
            loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                         "--tls-cert %s is not valid before %s (check the clock)", cert_path, when);
        goto fail;
    }
    out->not_after = (long long)not_after;
    return LOOM_OK;
fail:
    loom_http_tls_free(out);
    return st;
}

loom_status_t loom_http_tls_priorities(const char *given, loom_http_tls_t *t, loom_err_t *err) {
    const char *p = given && given[0] ? given : LOOM_HTTP_TLS_DEFAULT_PRIORITIES;
    gnutls_priority_t prio = NULL;
    const char *where = NULL;
    int rc = gnutls_priority_init(&prio, p, &where);
    if (rc < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--ssl-ciphers '%s': %s at '%.40s'", p, gnutls_strerror(rc),
                            where ? where : "?");
    gnutls_priority_deinit(prio);
    free(t->priorities);
    t->priorities = loom_xstrdup(p);
    return LOOM_OK;
}

void loom_http_tls_free(loom_http_tls_t *t) {
    if (!t) return;
    if (t->key_pem) memset(t->key_pem, 0, strlen(t->key_pem));
    free(t->cert_pem);
    free(t->key_pem);
    free(t->priorities);
    *t = (loom_http_tls_t){0};
}

/* The certificate date check (common/cert.h) on two certificates made with
 * openssl 3.0: a v1 one whose dates are UTCTime and already past (notAfter
 * before notBefore, openssl's -days -1), and a v3 one (an explicit [0]
 * version) whose notAfter is a GeneralizedTime in 2056. Their dates, as
 * `openssl x509 -noout -dates` and `date -u +%s` print them, are the expected
 * values. Then truncated and corrupted files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cert.h"
#include "tests/test.h"

/* notBefore 2026-12-04 13:13:45 UTC, notAfter 2026-12-03 13:13:45 UTC */
static const char k_v1_past[] =
    "-----BEGIN CERTIFICATE-----\n"
    "MIIBIjCByQIUVyh4tQJY7mwUuzXgyTPDiSY1RpEwCgYIKoZIzj0EAwIwFDESMBAG\n"
    "A1UEAwwJbG9vbS10ZXN0MB4XDTI2MTIwNDEzMTM0NVoXDTI2MTIwMzEzMTM0NVow\n"
    "FDESMBAGA1UEAwwJbG9vbS10ZXN0MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n"
    "HjYTUzgpBGhWWdelRv/e3+3q7iWRqUQtzU4HC5KujT4edO9+g0L6qAjc0rXhphuR\n"
    "4mjA9QU6eY7JDcBf9aq4ADAKBggqhkjOPQQDAgNIADBFAiByWVCZwC6pDgAEno+K\n"
    "7E6KyC0iSsWzAFqEG36KCZ58rQIhAM7nfPAcSTptTQCEbhqHeUpVZFhXixMieOvE\n"
    "48rnYY4x\n"
    "-----END CERTIFICATE-----\n";

/* notBefore 2026-12-04 13:13:41 UTC, notAfter 2056-11-26 13:13:41 UTC */
static const char k_v3_2056[] =
    "subject=CN = loom-test\n" /* text before the block, as `openssl x509 -text` leaves */
    "-----BEGIN CERTIFICATE-----\n"
    "MIIBgDCCASWgAwIBAgIUYenyZPpDeDt44QVqJi6Nf1T3mXkwCgYIKoZIzj0EAwIw\n"
    "FDESMBAGA1UEAwwJbG9vbS10ZXN0MCAXDTI2MTIwNDEzMTM0MVoYDzIwNTYxMTI2\n"
    "MTMxMzQxWjAUMRIwEAYDVQQDDAlsb29tLXRlc3QwWTATBgcqhkjOPQIBBggqhkjO\n"
    "PQMBBwNCAARTA+cCArGXnnHx6V7wSVHZ2L8qD/OUODv1e+pgS1OkEq7o4hZZK49m\n"
    "csoZIZpjHOW++0OsBwpVrBM99tA5wb2to1MwUTAdBgNVHQ4EFgQUYef0XDsryipk\n"
    "HpCs9PEceFH0BxIwHwYDVR0jBBgwFoAUYef0XDsryipkHpCs9PEceFH0BxIwDwYD\n"
    "VR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBGAiEAoZfd7dQRWjFHW95EAzqX\n"
    "EiTRkUxAY/s/n/4sSSPspEECIQCunpeLZvvXwa8KHJq25ryo6yFQJJWUsyK7QoJw\n"
    "yD+Obg==\n"
    "-----END CERTIFICATE-----\n";

static char g_path[64];

static const char *write_pem(const char *text, size_t len) {
    FILE *f = fopen(g_path, "wb");
    if (!f) return NULL;
    fwrite(text, 1, len, f);
    fclose(f);
    return g_path;
}

static void test_dates(void) {
    time_t nb = 0, na = 0;
    loom_err_t err;
    CHECKF(loom_cert_validity(write_pem(k_v1_past, strlen(k_v1_past)), &nb, &na, &err) == LOOM_OK, "%s", err.msg);
    CHECKF(nb == 1796390025 && na == 1796303625, "v1: %lld %lld", (long long)nb, (long long)na);
    CHECKF(loom_cert_validity(write_pem(k_v3_2056, strlen(k_v3_2056)), &nb, &na, &err) == LOOM_OK, "%s", err.msg);
    CHECKF(nb == 1796390021 && na == 2742470021, "v3: %lld %lld", (long long)nb, (long long)na);
}

static void test_check(void) {
    loom_err_t err;
    write_pem(k_v3_2056, strlen(k_v3_2056));
    CHECK(loom_cert_check_dates(g_path, "the cert", 1796390021, &err) == LOOM_OK);
    CHECK(loom_cert_check_dates(g_path, "the cert", 2742470021, &err) == LOOM_OK);
    CHECK(loom_cert_check_dates(g_path, "the cert", 2742470022, &err) == LOOM_ERR_UNAUTHENTICATED);
    CHECKF(strstr(err.msg, "the cert") && strstr(err.msg, "expired on 2056-11-26 13:13:41 UTC"), "%s", err.msg);
    CHECK(loom_cert_check_dates(g_path, "the cert", 1796390020, &err) == LOOM_ERR_UNAUTHENTICATED);
    CHECKF(strstr(err.msg, "is not valid until 2026-12-04 13:13:41 UTC"), "%s", err.msg);
    write_pem(k_v1_past, strlen(k_v1_past));
    CHECK(loom_cert_check_dates(g_path, "the cert", 1796390025, &err) == LOOM_ERR_UNAUTHENTICATED);
    CHECKF(strstr(err.msg, "expired on 2026-12-03 13:13:45 UTC"), "%s", err.msg);
}

static void test_malformed(void) {
    time_t nb, na;
    loom_err_t err;
    /* every truncation of the base64 body and a flipped byte in each DER header
     * position: an error or a date, never a crash (ASan watches the reads) */
    const char *body = strstr(k_v3_2056, "MII"), *tail = strstr(k_v3_2056, "-----END");
    size_t head = (size_t)(body - k_v3_2056);
    char buf[sizeof k_v3_2056 + 64];
    for (size_t cut = head; cut < (size_t)(tail - k_v3_2056); cut += 3) {
        int n = snprintf(buf, sizeof buf, "%.*s\n-----END CERTIFICATE-----\n", (int)cut, k_v3_2056);
        loom_status_t st = loom_cert_validity(write_pem(buf, (size_t)n), &nb, &na, &err);
        CHECK(st == LOOM_OK || st == LOOM_ERR_FORMAT);
    }
    for (size_t i = head; i < head + 80; i++) {
        memcpy(buf, k_v3_2056, sizeof k_v3_2056);
        buf[i] = buf[i] == 'A' ? 'B' : 'A';
        loom_status_t st = loom_cert_validity(write_pem(buf, strlen(buf)), &nb, &na, &err);
        CHECK(st == LOOM_OK || st == LOOM_ERR_FORMAT);
    }
    const char junk[] = "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n";
    CHECK(loom_cert_validity(write_pem(junk, strlen(junk)), &nb, &na, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "not an X.509 certificate"), "%s", err.msg);
    CHECK(loom_cert_check_dates(g_path, "x", 0, &err) == LOOM_OK); /* left to the TLS library */
    CHECK(loom_cert_validity(write_pem("hello\n", 6), &nb, &na, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "no PEM CERTIFICATE block"), "%s", err.msg);
    CHECK(loom_cert_validity("/nonexistent/cert.pem", &nb, &na, &err) != LOOM_OK);
}

int main(void) {
    snprintf(g_path, sizeof g_path, "/tmp/loom-test-cert-%d.pem", (int)getpid());
    RUN(test_dates);
    RUN(test_check);
    RUN(test_malformed);
    unlink(g_path);
    return test_summary();
}

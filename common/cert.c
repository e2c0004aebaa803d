/* X.509 validity dates from a PEM file (see cert.h). */
#include "common/cert.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/etcd.h"
#include "common/util.h"

/* One DER element: its tag, and where its contents start and end. */
typedef struct {
    unsigned tag;
    const uint8_t *body, *end;
} der_t;

/* Reads the element at *p (not past end) and moves *p past it. Definite
 * lengths only, as DER requires; at most 4 length bytes. */
static int der_next(const uint8_t **p, const uint8_t *end, der_t *d) {
    const uint8_t *q = *p;
    if (end - q < 2) return -1;
    d->tag = *q++;
    size_t len = *q++;
    if (len & 0x80) {
        size_t n = len & 0x7f;
        if (n == 0 || n > 4 || (size_t)(end - q) < n) return -1;
        len = 0;
        while (n--) len = len << 8 | *q++;
    }
    if ((size_t)(end - q) < len) return -1;
    d->body = q;
    d->end = q + len;
    *p = d->end;
    return 0;
}

/* Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
 * civil-from-days algorithm, inverted). */
static int64_t days_from_civil(int64_t y, unsigned m, unsigned d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (int64_t)doe - 719468;
}

static int digits(const uint8_t *s, int n) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v;
}

/* UTCTime YYMMDDHHMMSSZ (years 1950-2049) or GeneralizedTime
 * YYYYMMDDHHMMSSZ, the two forms RFC 5280 allows. */
static int der_time(const der_t *d, time_t *out) {
    size_t n = (size_t)(d->end - d->body);
    const uint8_t *s = d->body;
    int y;
    if (d->tag == 0x17 && n == 13) {
        y = digits(s, 2);
        if (y < 0) return -1;
        y += y < 50 ? 2000 : 1900;
        s += 2;
    } else if (d->tag == 0x18 && n == 15) {
        y = digits(s, 4);
        if (y < 0) return -1;
        s += 4;
    } else {
        return -1;
    }
    int mo = digits(s, 2), dd = digits(s + 2, 2), hh = digits(s + 4, 2), mi = digits(s + 6, 2),
        ss = digits(s + 8, 2);
    if (mo < 1 || mo > 12 || dd < 1 || dd > 31 || hh < 0 || hh > 23 || mi < 0 || mi > 59 || ss < 0 || ss > 60 ||
        s[10] != 'Z')
        return -1;
    *out = (time_t)(days_from_civil(y, (unsigned)mo, (unsigned)dd) * 86400 + hh * 3600 + mi * 60 + ss);
    return 0;
}

/* The DER bytes of the first CERTIFICATE block of a PEM text. */
static int pem_der(const char *text, size_t len, uint8_t **der, size_t *der_len) {
    static const char begin[] = "-----BEGIN CERTIFICATE-----", stop[] = "-----END CERTIFICATE-----";
    const char *b = memmem(text, len, begin, sizeof begin - 1);
    if (!b) return -1;
    b += sizeof begin - 1;
    const char *e = memmem(b, len - (size_t)(b - text), stop, sizeof stop - 1);
    if (!e) return -1;
    char *b64 = loom_xmalloc((size_t)(e - b) + 1);
    size_t n = 0;
    for (const char *c = b; c < e; c++)
        if (*c != '\n' && *c != '\r' && *c != ' ' && *c != '\t') b64[n++] = *c;
    *der = loom_xmalloc(3 * (n / 4) + 3);
    int rc = loom_b64_decode(b64, n, *der, der_len) == LOOM_OK ? 0 : -1;
    free(b64);
    if (rc) {
        free(*der);
        *der = NULL;
    }
    return rc;
}

loom_status_t loom_cert_validity(const char *path, time_t *not_before, time_t *not_after, loom_err_t *err) {
    char *text = NULL;
    size_t len = 0;
    LOOM_CHECK(loom_read_file(path, &text, &len, err));
    uint8_t *der = NULL;
    size_t der_len = 0;
    int bad = pem_der(text, len, &der, &der_len);
    free(text);
    if (bad) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: no PEM CERTIFICATE block", path);
    /* Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version
     * OPTIONAL, serialNumber, signature, issuer, validity, ... } ... } */
    const uint8_t *p = der, *end = der + der_len;
    der_t cert, tbs, el, nb, na;
    const char *why = NULL;
    if (der_next(&p, end, &cert) || cert.tag != 0x30) why = "not a DER SEQUENCE";
    p = cert.body;
    if (!why && (der_next(&p, cert.end, &tbs) || tbs.tag != 0x30)) why = "no tbsCertificate";
    if (!why) {
        p = tbs.body;
        if (der_next(&p, tbs.end, &el)) why = "truncated tbsCertificate";
        if (!why && el.tag == 0xa0 && der_next(&p, tbs.end, &el)) why = "no serial number"; /* el: serial */
        for (int i = 0; !why && i < 2; i++) /* signature algorithm, issuer */
            if (der_next(&p, tbs.end, &el) || el.tag != 0x30) why = "truncated before the validity";
    }
    if (!why) {
        der_t v;
        if (der_next(&p, tbs.end, &v) || v.tag != 0x30) {
            why = "no validity";
        } else {
            const uint8_t *q = v.body;
            if (der_next(&q, v.end, &nb) || der_next(&q, v.end, &na) || der_time(&nb, not_before) ||
                der_time(&na, not_after))
                why = "unreadable validity dates";
        }
    }
    free(der);
    if (why) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not an X.509 certificate (%s)", path, why);
    return LOOM_OK;
}

static void utc_text(time_t t, char *buf, size_t n) {
    struct tm tm;
    if (!gmtime_r(&t, &tm) || !strftime(buf, n, "%Y-%m-%d %H:%M:%S", &tm)) snprintf(buf, n, "%lld", (long long)t);
}

loom_status_t loom_cert_check_dates(const char *path, const char *what, time_t now, loom_err_t *err) {
    time_t nb, na;
    loom_err_t ignored;
    if (loom_cert_validity(path, &nb, &na, &ignored) != LOOM_OK) return LOOM_OK;
    char when[64];
    if (now > na) {
        utc_text(na, when, sizeof when);
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED, "%s (%s) expired on %s UTC", what, path, when);
    }
    if (now < nb) {
        utc_text(nb, when, sizeof when);
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED, "%s (%s) is not valid until %s UTC", what, path, when);
    }
    return LOOM_OK;
}

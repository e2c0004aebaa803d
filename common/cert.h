/* The validity dates of an X.509 certificate in a PEM file: enough DER to
 * find tbsCertificate.validity (RFC 5280 §4.1), so a process can say "your
 * certificate expired on ..." before a TLS peer refuses it with a bare "bad
 * certificate" alert. No signature or chain checking: that is the TLS
 * library's work. */
#ifndef LOOM_CERT_H
#define LOOM_CERT_H

#include <time.h>

#include "common/status.h"

/* Reads the first certificate of the PEM file at path; its notBefore and
 * notAfter as seconds since the epoch (UTC). LOOM_ERR_FORMAT names what is
 * malformed. */
loom_status_t loom_cert_validity(const char *path, time_t *not_before, time_t *not_after, loom_err_t *err);

/* OK when the certificate at path is valid at `now`; else an
 * LOOM_ERR_UNAUTHENTICATED error "<what> (<path>) expired on <date> UTC" (or
 * "is not valid until"). A file that cannot be parsed is left to the TLS
 * library (OK), so this check never refuses what TLS would accept. */
loom_status_t loom_cert_check_dates(const char *path, const char *what, time_t now, loom_err_t *err);

#endif

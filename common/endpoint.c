/* "host:port" -> "tcp://host:port"; addresses with a scheme pass unchanged. */
#include "common/endpoint.h"

#include <stdio.h>
#include <string.h>

int loom_endpoint_normalize(const char *addr, char *out, size_t n) {
    if (!n) return -1;
    out[0] = '\0';
    if (!addr || !addr[0]) return -1;
    int w = snprintf(out, n, "%s%s", strstr(addr, "://") ? "" : "tcp://", addr);
    if (w < 0 || (size_t)w >= n) {
        out[0] = '\0';
        return -1;
    }
    return 0;
}

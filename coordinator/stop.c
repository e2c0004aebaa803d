/* Stop-string matching for streamed text (see stop.h). */
#include "coordinator/stop.h"

#include <string.h>

long loom_stop_find(char *const *stops, int n, const char *text, size_t len) {
    long best = -1;
    for (int i = 0; i < n; i++) {
        size_t ls = strlen(stops[i]);
        if (ls == 0) continue;
        /* search only the part before the best hit so far */
        size_t span = best < 0 ? len : (size_t)best + ls - 1;
        if (span > len) span = len;
        const char *hit = memmem(text, span, stops[i], ls);
        if (hit && (best < 0 || hit - text < best)) best = (long)(hit - text);
    }
    return best;
}

size_t loom_stop_safe_prefix(char *const *stops, int n, const char *text, size_t len) {
    size_t keep = 0;
    for (int i = 0; i < n; i++) {
        size_t ls = strlen(stops[i]);
        if (ls == 0) continue;
        for (size_t k = ls - 1 < len ? ls - 1 : len; k > keep; k--)
            if (!memcmp(text + len - k, stops[i], k)) {
                keep = k;
                break;
            }
    }
    size_t out = len - keep;
    while (out > 0 && out < len && ((unsigned char)text[out] & 0xc0) == 0x80) out--; /* whole characters */
    return out;
}

size_t loom_stop_len_at(char *const *stops, int n, const char *text, size_t len, size_t pos) {
    for (int i = 0; i < n; i++) {
        size_t ls = strlen(stops[i]);
        if (ls && pos + ls <= len && !memcmp(text + pos, stops[i], ls)) return ls;
    }
    return 0;
}

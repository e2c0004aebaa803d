/* Text checks on raw protobuf bytes: protobuf-c hands string fields over as
 * C strings, so an embedded NUL would silently cut them and nothing checks
 * UTF-8. This walks the encoded message with its descriptor and refuses a
 * string field holding a NUL byte or invalid UTF-8, naming the field. */
#include <stdio.h>
#include <string.h>

#include "proto/wire.h"

#define MAX_DEPTH 8

static int read_varint(const uint8_t *p, size_t n, size_t *i, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *i < n; shift += 7) {
        uint8_t b = p[(*i)++];
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 1;
    }
    return 0;
}

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp, min;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xe0) == 0xc0) len = 2, cp = c & 0x1f, min = 0x80;
        else if ((c & 0xf0) == 0xe0) len = 3, cp = c & 0x0f, min = 0x800;
        else if ((c & 0xf8) == 0xf0) len = 4, cp = c & 0x07, min = 0x10000;
        else return 0;
        if (i + len > n) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += len;
    }
    return 1;
}

static loom_status_t walk(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n, int depth,
                          const char *path, loom_err_t *err) {
    size_t i = 0;
    while (i < n) {
        uint64_t key, v;
        if (!read_varint(p, n, &i, &key)) return LOOM_OK; /* the decoder judges malformed bytes */
        switch (key & 7) {
        case 0:
            if (!read_varint(p, n, &i, &v)) return LOOM_OK;
            break;
        case 1: i += 8; break;
        case 5: i += 4; break;
        case 2: {
            if (!read_varint(p, n, &i, &v) || v > n - i) return LOOM_OK;
            const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
            if (f) {
                char sub[256];
                snprintf(sub, sizeof sub, "%s%s%s", path, path[0] ? "." : "", f->name);
                if (f->type == PROTOBUF_C_TYPE_STRING) {
                    if (memchr(p + i, 0, (size_t)v))
                        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "field %s contains a NUL byte", sub);
                    if (!utf8_ok(p + i, (size_t)v))
                        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "field %s is not valid UTF-8", sub);
                } else if (f->type == PROTOBUF_C_TYPE_MESSAGE && depth < MAX_DEPTH) {
                    LOOM_CHECK(walk(f->descriptor, p + i, (size_t)v, depth + 1, sub, err));
                }
            }
            i += (size_t)v;
            break;
        }
        default: return LOOM_OK;
        }
    }
    return LOOM_OK;
}

loom_status_t loom_wire_check_text(const ProtobufCMessageDescriptor *d, const void *data, size_t len,
                                   loom_err_t *err) {
    return walk(d, data, len, 0, "", err);
}

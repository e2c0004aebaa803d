/* Strict JSON parsing for files Loom validates (config.json, safetensors
 * headers): the whole text must be one value, with only whitespace after it. */
#ifndef LOOM_JSON_H
#define LOOM_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

/* Parses `len` bytes that need not be NUL-terminated (they are copied so
 * cJSON always sees a terminator). Anything but whitespace after the value,
 * an embedded NUL included, is refused. NULL on failure, with *bad_at the
 * byte where parsing stopped. */
cJSON *loom_json_parse_strict(const char *text, size_t len, size_t *bad_at);

#endif

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

/* The first object key that appears twice in one object, at any depth:
 * 1 with its path written to path ("messages[0].role"), else 0. cJSON keeps
 * every duplicate and lookups see only the first, so a request or file
 * with two values for one key would mean different things to different
 * readers; strict readers refuse it. */
int loom_json_find_duplicate(const cJSON *root, char *path, size_t path_cap);

#endif

/* Strict JSON parsing (json.h). */
#include "common/json.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static int is_json_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

cJSON *loom_json_parse_strict(const char *text, size_t len, size_t *bad_at) {
    char *buf = loom_xmalloc(len + 1);
    if (len) memcpy(buf, text, len);
    buf[len] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(buf, &end, 0);
    size_t at = end && end >= buf ? (size_t)(end - buf) : 0;
    if (root) {
        while (at < len && is_json_space(buf[at])) at++;
        if (at < len) {
            cJSON_Delete(root);
            root = NULL;
        }
    }
    *bad_at = at;
    free(buf);
    return root;
}

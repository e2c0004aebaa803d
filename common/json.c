/* Strict JSON parsing (json.h). */
#include "common/json.h"

#include <stdio.h>
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

/* Appends ".key" or "[i]" to the path being built (truncated when long). */
static void path_push(char *path, size_t cap, size_t *len, const cJSON *parent, const cJSON *child, int index) {
    if (*len >= cap) return;
    int n = parent && cJSON_IsObject(parent)
                ? snprintf(path + *len, cap - *len, "%s%s", *len ? "." : "", child->string ? child->string : "")
                : snprintf(path + *len, cap - *len, "[%d]", index);
    if (n > 0) *len = LOOM_MIN(*len + (size_t)n, cap - 1);
}

static int cmp_key(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* A key of object o that appears twice, or NULL: pairwise for small
 * objects, sorted for large ones (a 2 MiB body can hold 10^5 keys). */
static const cJSON *dup_key(const cJSON *o) {
    size_t n = 0;
    for (const cJSON *c = o->child; c; c = c->next) n++;
    if (n <= 16) {
        for (const cJSON *c = o->child; c; c = c->next)
            for (const cJSON *d = o->child; d != c; d = d->next)
                if (!strcmp(d->string, c->string)) return c;
        return NULL;
    }
    const cJSON **keys = loom_xmalloc(n * sizeof *keys);
    size_t k = 0;
    for (const cJSON *c = o->child; c; c = c->next) keys[k++] = c;
    qsort(keys, n, sizeof *keys, cmp_key);
    const cJSON *found = NULL;
    for (size_t i = 1; i < n && !found; i++)
        if (!strcmp(keys[i - 1]->string, keys[i]->string)) found = keys[i];
    free(keys);
    return found;
}

static int find_dup(const cJSON *node, char *path, size_t cap, size_t len, int depth) {
    if (depth > 1000) return 0; /* cJSON nests at most CJSON_NESTING_LIMIT (1000) deep */
    if (!cJSON_IsObject(node) && !cJSON_IsArray(node)) return 0;
    if (cJSON_IsObject(node)) {
        const cJSON *d = dup_key(node);
        if (d) {
            path_push(path, cap, &len, node, d, 0);
            return 1;
        }
    }
    int index = 0;
    for (const cJSON *c = node->child; c; c = c->next, index++) {
        size_t l = len;
        path_push(path, cap, &l, node, c, index);
        if (find_dup(c, path, cap, l, depth + 1)) return 1;
        path[len] = '\0';
    }
    return 0;
}

int loom_json_find_duplicate(const cJSON *root, char *path, size_t path_cap) {
    if (!path || !path_cap) return 0;
    path[0] = '\0';
    return find_dup(root, path, path_cap, 0, 0);
}

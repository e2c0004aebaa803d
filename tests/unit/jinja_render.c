/* loom-jinja-render: renders a batch of Jinja cases with Loom's engine, for
 * the conformance tests that compare it with python's jinja2
 * (tests/reference/jinja_ref.py). Reads {"cases": [{"name", "template",
 * "vars"}, ...]} from a file (or stdin with "-") and prints a JSON array of
 * {"name", "ok", "out"} or {"name", "ok": false, "code", "msg"}; with
 * --spans, each ok result also carries "spans": [[begin, end], ...]. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/jinja.h"

static char *read_all(const char *path, size_t *len) {
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 4096 > cap) {
            cap *= 2;
            char *b = realloc(buf, cap);
            if (!b) {
                free(buf);
                return NULL;
            }
            buf = b;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        if (r == 0) break;
        n += r;
    }
    if (f != stdin) fclose(f);
    buf[n] = '\0';
    *len = n;
    return buf;
}

int main(int argc, char **argv) {
    const char *path = NULL;
    int spans = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--spans") == 0)
            spans = 1;
        else
            path = argv[i];
    }
    if (!path) {
        fprintf(stderr, "usage: loom-jinja-render [--spans] CASES.json|-\n");
        return 2;
    }
    size_t len = 0;
    char *text = read_all(path, &len);
    if (!text) {
        fprintf(stderr, "cannot read %s\n", path);
        return 2;
    }
    cJSON *doc = cJSON_ParseWithLength(text, len);
    free(text);
    cJSON *cases = doc ? cJSON_GetObjectItemCaseSensitive(doc, "cases") : NULL;
    if (!cJSON_IsArray(cases)) {
        fprintf(stderr, "%s: expected {\"cases\": [...]}\n", path);
        cJSON_Delete(doc);
        return 2;
    }
    cJSON *results = cJSON_CreateArray();
    cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(c, "name"));
        const char *tpl = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(c, "template"));
        const cJSON *vars = cJSON_GetObjectItemCaseSensitive(c, "vars");
        const cJSON *lim_j = cJSON_GetObjectItemCaseSensitive(c, "limits");
        loom_jinja_limits_t lim = {0};
        if (lim_j) {
            cJSON *x;
            if ((x = cJSON_GetObjectItemCaseSensitive(lim_j, "max_output")))
                lim.max_output = (size_t)x->valuedouble;
            if ((x = cJSON_GetObjectItemCaseSensitive(lim_j, "max_steps")))
                lim.max_steps = (uint64_t)x->valuedouble;
            if ((x = cJSON_GetObjectItemCaseSensitive(lim_j, "max_depth")))
                lim.max_depth = (int)x->valuedouble;
        }
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "name", name ? name : "");
        loom_err_t err = {0};
        loom_jinja_t *t = NULL;
        loom_status_t s = loom_jinja_compile(tpl ? tpl : "", tpl ? strlen(tpl) : 0,
                                             name ? name : "case", &t, &err);
        char *out = NULL;
        size_t out_len = 0, n_sp = 0;
        loom_jinja_span_t *sp = NULL;
        if (s == LOOM_OK) {
            cJSON *empty = NULL;
            if (!cJSON_IsObject(vars)) vars = empty = cJSON_CreateObject();
            s = spans ? loom_jinja_render_spans(t, vars, &lim, &out, &out_len, &sp, &n_sp, &err)
                      : loom_jinja_render(t, vars, &lim, &out, &out_len, &err);
            cJSON_Delete(empty);
        }
        cJSON_AddBoolToObject(r, "ok", s == LOOM_OK);
        if (s == LOOM_OK) {
            if (strlen(out) != out_len) cJSON_AddBoolToObject(r, "has_nul", 1);
            cJSON_AddStringToObject(r, "out", out);
            if (spans) {
                cJSON *a = cJSON_AddArrayToObject(r, "spans");
                for (size_t i = 0; i < n_sp; i++) {
                    cJSON *pair = cJSON_CreateArray();
                    cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)sp[i].begin));
                    cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)sp[i].end));
                    cJSON_AddItemToArray(a, pair);
                }
            }
        } else {
            cJSON_AddStringToObject(r, "code", loom_status_str(s));
            cJSON_AddStringToObject(r, "msg", err.msg);
        }
        free(out);
        free(sp);
        loom_jinja_destroy(&t);
        cJSON_AddItemToArray(results, r);
    }
    char *js = cJSON_PrintUnformatted(results);
    fputs(js, stdout);
    fputc('\n', stdout);
    free(js);
    cJSON_Delete(results);
    cJSON_Delete(doc);
    return 0;
}

/* Forced tool calls in a model's own syntax (LOOM_GRAMMAR_TOOL_CALLS, see
 * grammar.h): the markup around the calls, the calls written as JSON call
 * objects, as a pythonic list or as Qwen3-Coder's XML-like blocks, and the
 * markup's special tokens taken as the tokens themselves.
 *
 *   root ::= begin item ( sep item ){min-1, max-1} end
 *   item ::= item_begin ( call_1 | call_2 | ... ) item_end
 *   call_i ::= prefix_i schema_i                             syntax "json"
 *            | NAME "(" KEY "=" value (", " KEY "=" value)* ")"    "pythonic"
 *            | "<tool_call>\n<function=NAME>\n"                    "qwen3_coder"
 *                ("<parameter=KEY>\n" value "\n</parameter>\n")*
 *              "</function>\n</tool_call>"
 *
 * The pythonic form is what gateway/tool_parsers.c reads back: keyword
 * arguments of Python literals; the Qwen3-Coder form too: a parameter whose
 * schema type is "string" is its raw text (no '<', so "</parameter>" cannot
 * come early), any other type one JSON value. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar_impl.h"
#include "common/json.h"
#include "common/util.h"

#define MAX_SPECIAL 32

typedef struct {
    const char *text;
    size_t len;
    int32_t id;
} special_t;

typedef struct {
    loom_gb_t *gb;
    loom_js_t *js;
    special_t sp[MAX_SPECIAL];
    int n_sp;
} tg_t;

static const char *spec_str(const cJSON *spec, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(spec, k);
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* Markup text: bytes, except that a special token's text is that token. */
static void add_markup(tg_t *t, int rule, const char *s) {
    size_t n = strlen(s), from = 0;
    loom_gb_add_lit(t->gb, rule, "", 0);
    for (size_t i = 0; i < n;) {
        int k = 0;
        while (k < t->n_sp &&
               (t->sp[k].len > n - i || memcmp(s + i, t->sp[k].text, t->sp[k].len) != 0))
            k++;
        if (k == t->n_sp) {
            i++;
            continue;
        }
        loom_gb_add_lit(t->gb, rule, s + from, i - from);
        loom_gb_add_token(t->gb, rule, t->sp[k].id, t->sp[k].text, t->sp[k].len);
        i += t->sp[k].len;
        from = i;
    }
    loom_gb_add_lit(t->gb, rule, s + from, n - from);
}

/* "special_tokens": {"TEXT": id, ...}; 0 or -1 with the error set. */
static int read_special(tg_t *t, const cJSON *spec) {
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(spec, "special_tokens"), *e;
    if (!sp) return 0;
    if (!cJSON_IsObject(sp))
        return loom_js_fail(t->js, LOOM_ERR_INVALID_ARGUMENT, "tool calls grammar: %s",
                            "special_tokens must be an object of token ids");
    cJSON_ArrayForEach(e, sp) {
        if (!e->string[0] || !cJSON_IsNumber(e) || e->valuedouble < 0 ||
            e->valuedouble > 0x3FFFFFFF || e->valuedouble != (double)(int32_t)e->valuedouble)
            return loom_js_fail(t->js, LOOM_ERR_INVALID_ARGUMENT,
                                "tool calls grammar: special token '%s' needs a "
                                "text and a token id",
                                e->string);
        if (t->n_sp == MAX_SPECIAL)
            return loom_js_fail(t->js, LOOM_ERR_INVALID_ARGUMENT, "tool calls grammar: %s",
                                "more than 32 special_tokens");
        t->sp[t->n_sp++] = (special_t){e->string, strlen(e->string), (int32_t)e->valuedouble};
    }
    return 0;
}

/* ---- pythonic ---- */

static int py_ident(const char *s, int dotted) {
    if (!(*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z'))) return 0;
    for (s++; *s; s++)
        if (!(*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
              (*s >= '0' && *s <= '9') || (dotted && (*s == '.' || *s == '-'))))
            return 0;
    return 1;
}

static int py_kw_value(loom_js_t *j, const char *key, const cJSON *schema, void *ctx) {
    const cJSON *doc = ctx;
    if (!py_ident(key, 0))
        return loom_js_fail(
            j, LOOM_ERR_UNSUPPORTED,
            "tool calls grammar: parameter '%s' is not a Python identifier (pythonic syntax)", key);
    return loom_js_schema(j, doc, schema);
}

/* NAME(KEY=value, ...) */
static int pythonic_call(tg_t *t, const char *name, const cJSON *params) {
    if (!py_ident(name, 1))
        return loom_js_fail(t->js, LOOM_ERR_UNSUPPORTED,
                            "tool calls grammar: '%s' cannot be called in the pythonic syntax",
                            name);
    loom_js_members_t style = {.pre = "",
                               .mid = "=",
                               .post = "",
                               .sep = ", ",
                               .value = py_kw_value,
                               .ctx = (void *)params};
    int args = loom_js_members(t->js, params, &style);
    if (args < 0) return -1;
    int r = loom_gb_rule(t->gb, NULL);
    loom_gb_alt(t->gb, r);
    loom_gb_add_lit(t->gb, r, name, strlen(name));
    loom_gb_add_byte(t->gb, r, '(');
    loom_gb_add_ref(t->gb, r, args);
    loom_gb_add_byte(t->gb, r, ')');
    return r;
}

/* ---- qwen3_coder ---- */

/* A raw text value: characters other than '<' and control characters
 * (newline and tab allowed), min..max of them. */
static int raw_text(loom_gb_t *gb, int min, int max) {
    loom_gb_set_t ok = {{0}};
    loom_gb_set_range(&ok, 0x20, 0x7E);
    ok.b['<' >> 3] = (uint8_t)(ok.b['<' >> 3] & ~(1u << ('<' & 7)));
    loom_gb_set_add(&ok, '\n');
    loom_gb_set_add(&ok, '\t');
    return loom_gb_repeat(gb, loom_gb_utf8_char(gb, &ok), min, max);
}

static int coder_count(loom_js_t *j, const cJSON *s, const char *key, int dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!v) return dflt;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 4096 ||
        v->valuedouble != (int)v->valuedouble)
        return loom_js_fail(j, LOOM_ERR_UNSUPPORTED,
                            "tool calls grammar: '%s' must be an integer in [0, 4096]", key),
               dflt;
    return (int)v->valuedouble;
}

/* A string parameter written raw: its enum/const literally, its pattern or
 * format as a regex, else text within its length bounds. */
static int coder_string(loom_js_t *j, loom_gb_t *gb, const char *key, const cJSON *schema) {
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(schema, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(schema, "const");
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(schema, "pattern");
    if (cJSON_GetObjectItemCaseSensitive(schema, "format"))
        return loom_js_fail(
            j, LOOM_ERR_UNSUPPORTED,
            "tool calls grammar: string parameter '%s' with a format (qwen3_coder syntax)", key);
    if (en || cn) {
        int r = loom_gb_rule(gb, NULL);
        const cJSON *v;
        if (cn) {
            if (!cJSON_IsString(cn)) goto not_strings;
            loom_gb_alt(gb, r);
            loom_gb_add_lit(gb, r, cn->valuestring, strlen(cn->valuestring));
            return r;
        }
        if (!cJSON_IsArray(en) || !en->child) goto not_strings;
        cJSON_ArrayForEach(v, en) {
            if (!cJSON_IsString(v)) goto not_strings;
            loom_gb_alt(gb, r);
            loom_gb_add_lit(gb, r, v->valuestring, strlen(v->valuestring));
        }
        return r;
    }
    if (pat) {
        if (!cJSON_IsString(pat))
            return loom_js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: '%s' must be a string",
                                "pattern");
        const char *p = pat->valuestring;
        size_t n = strlen(p);
        int a0 = n > 0 && p[0] == '^', a1 = n > 0 && p[n - 1] == '$' && (n < 2 || p[n - 2] != '\\');
        if (a0) p++, n--;
        if (a1 && n > 0) n--;
        char *re = loom_xmalloc(n + 32);
        snprintf(re, n + 32, "%s(?:%.*s)%s", a0 ? "" : ".*", (int)n, p, a1 ? "" : ".*");
        int r = -1;
        loom_err_t e2;
        loom_status_t st = loom_regex_to_rule(gb, re, strlen(re), 0, &r, &e2);
        free(re);
        if (st < 0) return loom_js_fail(j, st, "json schema: pattern: %s", e2.msg);
        return r;
    }
    int min = coder_count(j, schema, "minLength", 0), max = coder_count(j, schema, "maxLength", -1);
    if (loom_js_status(j) < 0) return -1;
    if (max >= 0 && min > max)
        return loom_js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                            "minLength > maxLength");
    return raw_text(gb, min, max);
not_strings:
    return loom_js_fail(
        j, LOOM_ERR_UNSUPPORTED,
        "tool calls grammar: string parameter '%s' with an enum or const that is not strings", key);
}

typedef struct {
    loom_gb_t *gb;
    const cJSON *doc;
} coder_ctx_t;

/* A parameter's value as gateway/tool_parsers.c types it: by its schema's
 * one "type", raw text for a string, one JSON value for the others. */
static int coder_value(loom_js_t *j, const char *key, const cJSON *schema, void *ctx) {
    coder_ctx_t *c = ctx;
    if (strchr(key, '>') || strchr(key, '<'))
        return loom_js_fail(j, LOOM_ERR_UNSUPPORTED,
                            "tool calls grammar: parameter '%s' cannot be written in the "
                            "qwen3_coder syntax",
                            key);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(schema, "type");
    if (!cJSON_IsString(type))
        return loom_js_fail(
            j, LOOM_ERR_UNSUPPORTED,
            "tool calls grammar: parameter '%s' needs one 'type' (qwen3_coder syntax)", key);
    if (!strcmp(type->valuestring, "string")) return coder_string(j, c->gb, key, schema);
    return loom_js_schema(j, c->doc, schema);
}

/* <tool_call>\n<function=NAME>\n (<parameter=KEY>\nVALUE\n</parameter>\n)*
 * </function>\n</tool_call> */
static int coder_call(tg_t *t, const char *name, const cJSON *params, int rule) {
    if (strchr(name, '>') || strchr(name, '<'))
        return loom_js_fail(t->js, LOOM_ERR_UNSUPPORTED,
                            "tool calls grammar: '%s' cannot be called in the qwen3_coder syntax",
                            name);
    coder_ctx_t c = {t->gb, params};
    loom_js_members_t style = {.pre = "<parameter=",
                               .mid = ">\n",
                               .post = "\n</parameter>\n",
                               .sep = "",
                               .value = coder_value,
                               .ctx = &c};
    int args = loom_js_members(t->js, params, &style);
    if (args < 0) return -1;
    add_markup(t, rule, "<tool_call>\n<function=");
    loom_gb_add_lit(t->gb, rule, name, strlen(name));
    add_markup(t, rule, ">\n");
    loom_gb_add_ref(t->gb, rule, args);
    add_markup(t, rule, "</function>\n</tool_call>");
    return 0;
}

/* One alternative of the call rule for items[k]. */
static int add_call(tg_t *t, const char *syntax, const cJSON *item, const cJSON *prefix, int any) {
    if (!strcmp(syntax, "json")) {
        int r = loom_js_schema(t->js, item, item);
        if (r < 0) return -1;
        loom_gb_alt(t->gb, any);
        if (cJSON_IsString(prefix)) add_markup(t, any, prefix->valuestring);
        loom_gb_add_ref(t->gb, any, r);
        return 0;
    }
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(item, "name");
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(item, "parameters");
    if (!cJSON_IsString(name) || !name->valuestring[0] || !cJSON_IsObject(params))
        return loom_js_fail(
            t->js, LOOM_ERR_INVALID_ARGUMENT, "tool calls grammar: %s",
            "a pythonic or qwen3_coder item is {\"name\": ..., \"parameters\": {...}}");
    if (!strcmp(syntax, "pythonic")) {
        int r = pythonic_call(t, name->valuestring, params);
        if (r < 0) return -1;
        loom_gb_alt(t->gb, any);
        loom_gb_add_ref(t->gb, any, r);
        return 0;
    }
    int r = loom_gb_rule(t->gb, NULL);
    loom_gb_alt(t->gb, r);
    if (coder_call(t, name->valuestring, params, r) < 0) return -1;
    loom_gb_alt(t->gb, any);
    loom_gb_add_ref(t->gb, any, r);
    return 0;
}

/* root ::= begin item (sep item){min-1,max-1} end, item ::= item_begin any item_end */
static int add_root(tg_t *t, const cJSON *spec, int any) {
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(spec, "min"),
                *mx = cJSON_GetObjectItemCaseSensitive(spec, "max");
    int min = cJSON_IsNumber(mn) && mn->valueint > 0 ? mn->valueint : 1;
    int max = cJSON_IsNumber(mx) && mx->valueint > 0 ? mx->valueint : -1;
    if (max > 0 && max < min) max = min;
    int item = loom_gb_rule(t->gb, NULL);
    loom_gb_alt(t->gb, item);
    add_markup(t, item, spec_str(spec, "item_begin"));
    loom_gb_add_ref(t->gb, item, any);
    add_markup(t, item, spec_str(spec, "item_end"));
    int next = loom_gb_rule(t->gb, NULL); /* sep item */
    loom_gb_alt(t->gb, next);
    add_markup(t, next, spec_str(spec, "sep"));
    loom_gb_add_ref(t->gb, next, item);
    int root = loom_gb_rule(t->gb, "root");
    loom_gb_alt(t->gb, root);
    add_markup(t, root, spec_str(spec, "begin"));
    loom_gb_add_ref(t->gb, root, item);
    if (max != 1)
        loom_gb_add_ref(t->gb, root, loom_gb_repeat(t->gb, next, min - 1, max < 0 ? -1 : max - 1));
    add_markup(t, root, spec_str(spec, "end"));
    return root;
}

loom_status_t loom_grammar_compile_tool_calls(const char *spec_text, size_t len,
                                              loom_grammar_t **out, loom_err_t *err) {
    *out = NULL;
    size_t bad = 0;
    cJSON *spec = loom_json_parse_strict(spec_text, len, &bad);
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(spec, "items");
    if (!cJSON_IsArray(items) || !items->child) {
        cJSON_Delete(spec);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tool calls grammar: needs a non-empty items array");
    }
    const char *syntax = cJSON_IsString(cJSON_GetObjectItemCaseSensitive(spec, "syntax"))
                             ? spec_str(spec, "syntax")
                             : "json";
    if (strcmp(syntax, "json") && strcmp(syntax, "pythonic") && strcmp(syntax, "qwen3_coder")) {
        loom_status_t st = loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "tool calls grammar: syntax '%.32s' is not json, pythonic or qwen3_coder", syntax);
        cJSON_Delete(spec);
        return st;
    }
    tg_t t = {.gb = loom_gb_create()};
    t.js = loom_js_create(t.gb, !strcmp(syntax, "pythonic") ? LOOM_JS_PYTHON : LOOM_JS_JSON,
                          !strcmp(syntax, "qwen3_coder"), err);
    int any = loom_gb_rule(t.gb, NULL), root = -1;
    const cJSON *it, *prefixes = cJSON_GetObjectItemCaseSensitive(spec, "prefixes");
    int k = 0;
    if (read_special(&t, spec) == 0) {
        cJSON_ArrayForEach(it, items) {
            if (add_call(&t, syntax, it, cJSON_GetArrayItem(prefixes, k++), any) < 0) break;
        }
    }
    loom_status_t st = loom_js_status(t.js);
    if (st >= 0) root = add_root(&t, spec, any);
    loom_js_destroy(&t.js);
    cJSON_Delete(spec);
    if (st < 0) {
        loom_gb_destroy(&t.gb);
        return st;
    }
    return loom_gb_finish(&t.gb, root, out, err);
}

/* JSON Schema (the subset OpenAI strict mode, Pydantic and zod emit) to the
 * grammar IR; also "any JSON object" and a list of choices.
 *
 * Output shape: properties in the order the schema lists them, required ones
 * always present, optional ones may be left out; "additionalProperties"
 * absent or false allows no other keys (strict), true or a schema allows
 * further "key": value pairs after the listed ones. Whitespace between
 * tokens is free up to 4 characters ([ \t\n]{0,4}). oneOf is matched as anyOf (its branches are
 * expected to be disjoint, as discriminated unions are). Numeric bounds
 * (minimum, multipleOf, ...) and the other keywords not listed in KNOWN are
 * refused by name. Formats: date, time, date-time, uuid, email (generated
 * from a safe subset: e.g. years 1000-2999 and days 01-28, so every output is a real date). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar_impl.h"
#include "common/json.h"
#include "common/util.h"

typedef struct {
    char *ref;
    int rule;
} ref_rule_t;

typedef struct loom_js {
    loom_gb_t *gb;
    const cJSON *doc;
    loom_err_t *err;
    loom_status_t st;
    int depth;
    int ws, value, string, number, integer, object_any, array_any, member_any;
    ref_rule_t *refs;
    int n_refs;
    loom_js_syntax_t syntax; /* JSON, or Python literals (pythonic tool calls) */
    int no_lt;               /* strings never hold '<' (values inside markup that '<' would end) */
    int doc_no;              /* documents seen before doc (several tools' schemas in one grammar) */
} js_t;

#define PY(j) ((j)->syntax == LOOM_JS_PYTHON)

static const char *const KNOWN[] = {
    "type",        "properties", "required",      "additionalProperties",
    "items",       "minItems",   "maxItems",      "enum",
    "const",       "anyOf",      "oneOf",         "allOf",
    "$ref",        "$defs",      "definitions",   "minLength",
    "maxLength",   "pattern",    "format",        "title",
    "description", "default",    "examples",      "$schema",
    "$id",         "$comment",   "discriminator", "readOnly",
    "writeOnly",   "deprecated", "strict",        NULL};

static int js_fail(js_t *j, loom_status_t code, const char *fmt, const char *arg) {
    if (j->st >= 0) j->st = loom_err_set(j->err, code, fmt, arg);
    return -1;
}

static int js_regex(js_t *j, const char *re, int json_string) {
    int r = -1;
    loom_err_t e2;
    loom_status_t st = loom_regex_to_rule(j->gb, re, strlen(re), json_string, &r, &e2);
    if (st < 0) return js_fail(j, st, "json schema: pattern: %s", e2.msg);
    return r;
}

/* Whitespace between tokens: at most this many characters, so a model that
 * favours blanks cannot run out its budget on them (a compact or indented
 * document still fits). */
#define LOOM_JSON_MAX_WS 4

static int rule_ws(js_t *j) {
    if (j->ws < 0) {
        loom_gb_set_t s = {{0}};
        loom_gb_set_add(&s, ' ');
        loom_gb_set_add(&s, '\t');
        loom_gb_set_add(&s, '\n');
        int one = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, one);
        loom_gb_add_set(j->gb, one, &s);
        j->ws = loom_gb_repeat(j->gb, one, 0, LOOM_JSON_MAX_WS);
    }
    return j->ws;
}

/* One character of a JSON string body. */
static int rule_json_char(js_t *j) {
    loom_gb_set_t ok = {{0}};
    loom_gb_set_range(&ok, 0x20, 0x7F);
    ok.b['"' >> 3] = (uint8_t)(ok.b['"' >> 3] & ~(1u << ('"' & 7)));
    ok.b['\\' >> 3] = (uint8_t)(ok.b['\\' >> 3] & ~(1u << ('\\' & 7)));
    if (j->no_lt) ok.b['<' >> 3] = (uint8_t)(ok.b['<' >> 3] & ~(1u << ('<' & 7)));
    int ch = loom_gb_utf8_char(j->gb, &ok);
    int r = loom_gb_rule(j->gb, NULL);
    loom_gb_alt(j->gb, r);
    loom_gb_add_ref(j->gb, r, ch);
    loom_gb_set_t esc = {{0}};
    /* Python: only the escapes a pythonic reader turns back into the same character */
    const char *e = PY(j) ? "\"\\nrt" : "\"\\/bfnrt";
    for (; *e; e++)
        loom_gb_set_add(&esc, (unsigned char)*e);
    loom_gb_alt(j->gb, r);
    loom_gb_add_byte(j->gb, r, '\\');
    loom_gb_add_set(j->gb, r, &esc);
    if (PY(j)) return r;
    loom_gb_set_t hex = {{0}};
    loom_gb_set_range(&hex, '0', '9');
    loom_gb_set_range(&hex, 'a', 'f');
    loom_gb_set_range(&hex, 'A', 'F');
    loom_gb_alt(j->gb, r);
    loom_gb_add_lit(j->gb, r, "\\u", 2);
    /* \u escapes limited to the BMP outside surrogates: first digit 0-c or e-f */
    loom_gb_set_t h1 = {{0}};
    loom_gb_set_range(&h1, '0', '9');
    loom_gb_set_range(&h1, 'a', 'c');
    loom_gb_set_range(&h1, 'A', 'C');
    loom_gb_set_range(&h1, 'e', 'f');
    loom_gb_set_range(&h1, 'E', 'F');
    loom_gb_add_set(j->gb, r, &h1);
    for (int k = 0; k < 3; k++)
        loom_gb_add_set(j->gb, r, &hex);
    return r;
}

static int rule_string(js_t *j, int min, int max) {
    int body = loom_gb_repeat(j->gb, rule_json_char(j), min, max);
    int r = loom_gb_rule(j->gb, NULL);
    loom_gb_alt(j->gb, r);
    loom_gb_add_byte(j->gb, r, '"');
    loom_gb_add_ref(j->gb, r, body);
    loom_gb_add_byte(j->gb, r, '"');
    return r;
}

static int rule_any_string(js_t *j) {
    if (j->string < 0) j->string = rule_string(j, 0, -1);
    return j->string;
}

static int rule_number(js_t *j) {
    if (j->number < 0)
        j->number =
            js_regex(j, "-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,15})?([eE][-+]?[1-9][0-9]?)?", 0);
    return j->number;
}
static int rule_integer(js_t *j) {
    if (j->integer < 0) j->integer = js_regex(j, "-?(0|[1-9][0-9]{0,15})", 0);
    return j->integer;
}

static int rule_any_value(js_t *j);

/* "{" ws ( member ( "," ws member )* )? "}" with member = string ws ":" ws value ws */
static int rule_object_any(js_t *j) {
    if (j->object_any >= 0) return j->object_any;
    j->object_any = loom_gb_rule(j->gb, NULL);
    int ws = rule_ws(j);
    int mem = loom_gb_rule(j->gb, NULL);
    j->member_any = mem;
    loom_gb_alt(j->gb, mem);
    loom_gb_add_ref(j->gb, mem, rule_any_string(j));
    loom_gb_add_ref(j->gb, mem, ws);
    loom_gb_add_byte(j->gb, mem, ':');
    loom_gb_add_ref(j->gb, mem, ws);
    loom_gb_add_ref(j->gb, mem, rule_any_value(j));
    loom_gb_add_ref(j->gb, mem, ws);
    int more = loom_gb_rule(j->gb, NULL);
    loom_gb_alt(j->gb, more);
    loom_gb_add_byte(j->gb, more, ',');
    loom_gb_add_ref(j->gb, more, ws);
    loom_gb_add_ref(j->gb, more, mem);
    int o = j->object_any;
    loom_gb_alt(j->gb, o);
    loom_gb_add_byte(j->gb, o, '{');
    loom_gb_add_ref(j->gb, o, ws);
    loom_gb_add_byte(j->gb, o, '}');
    loom_gb_alt(j->gb, o);
    loom_gb_add_byte(j->gb, o, '{');
    loom_gb_add_ref(j->gb, o, ws);
    loom_gb_add_ref(j->gb, o, mem);
    loom_gb_add_ref(j->gb, o, loom_gb_star(j->gb, more));
    loom_gb_add_byte(j->gb, o, '}');
    return o;
}

static int rule_array_of(js_t *j, int item, int min, int max) {
    int ws = rule_ws(j);
    int r = loom_gb_rule(j->gb, NULL);
    if (min == 0) {
        loom_gb_alt(j->gb, r);
        loom_gb_add_byte(j->gb, r, '[');
        loom_gb_add_ref(j->gb, r, ws);
        loom_gb_add_byte(j->gb, r, ']');
    }
    if (max != 0) {
        int more = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, more);
        loom_gb_add_byte(j->gb, more, ',');
        loom_gb_add_ref(j->gb, more, ws);
        loom_gb_add_ref(j->gb, more, item);
        loom_gb_add_ref(j->gb, more, ws);
        int rest = loom_gb_repeat(j->gb, more, min > 1 ? min - 1 : 0, max < 0 ? -1 : max - 1);
        loom_gb_alt(j->gb, r);
        loom_gb_add_byte(j->gb, r, '[');
        loom_gb_add_ref(j->gb, r, ws);
        loom_gb_add_ref(j->gb, r, item);
        loom_gb_add_ref(j->gb, r, ws);
        loom_gb_add_ref(j->gb, r, rest);
        loom_gb_add_byte(j->gb, r, ']');
    }
    return r;
}

static int rule_any_value(js_t *j) {
    if (j->value >= 0) return j->value;
    j->value = loom_gb_rule(j->gb, NULL);
    int v = j->value;
    j->array_any = loom_gb_rule(j->gb, NULL);
    int arr = rule_array_of(j, v, 0, -1);
    loom_gb_alt(j->gb, j->array_any);
    loom_gb_add_ref(j->gb, j->array_any, arr);
    int parts[] = {rule_object_any(j), j->array_any, rule_any_string(j), rule_number(j)};
    for (int k = 0; k < 4; k++) {
        loom_gb_alt(j->gb, v);
        loom_gb_add_ref(j->gb, v, parts[k]);
    }
    const char *json_lits[] = {"true", "false", "null"}, *py_lits[] = {"True", "False", "None"};
    const char **lits = PY(j) ? py_lits : json_lits;
    for (int k = 0; k < 3; k++) {
        loom_gb_alt(j->gb, v);
        loom_gb_add_lit(j->gb, v, lits[k], strlen(lits[k]));
    }
    return v;
}

/* A string as a Python literal in double quotes, with the escapes a
 * pythonic reader turns back (-1: a control character it cannot write). */
static int py_quote(loom_sbuf_t *b, const char *s) {
    loom_sbuf_add(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc = *p == '"' || *p == '\\' ? (char)*p
                   : *p == '\n'            ? 'n'
                   : *p == '\r'            ? 'r'
                   : *p == '\t'            ? 't'
                                           : 0;
        if (esc) {
            loom_sbuf_add(b, "\\", 1);
            loom_sbuf_add(b, &esc, 1);
        } else if (*p < 0x20) {
            return -1;
        } else {
            loom_sbuf_add(b, p, 1);
        }
    }
    loom_sbuf_add(b, "\"", 1);
    return 0;
}

/* A JSON value written as a Python literal (True/False/None, dicts, lists). */
static int py_literal(loom_sbuf_t *b, const cJSON *v) {
    if (cJSON_IsTrue(v))
        loom_sbuf_str(b, "True");
    else if (cJSON_IsFalse(v))
        loom_sbuf_str(b, "False");
    else if (cJSON_IsNull(v))
        loom_sbuf_str(b, "None");
    else if (cJSON_IsString(v))
        return py_quote(b, v->valuestring);
    else if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        loom_sbuf_add(b, cJSON_IsArray(v) ? "[" : "{", 1);
        const cJSON *x;
        cJSON_ArrayForEach(x, v) {
            if (x != v->child) loom_sbuf_str(b, ", ");
            if (cJSON_IsObject(v)) {
                if (py_quote(b, x->string) < 0) return -1;
                loom_sbuf_str(b, ": ");
            }
            if (py_literal(b, x) < 0) return -1;
        }
        loom_sbuf_add(b, cJSON_IsArray(v) ? "]" : "}", 1);
    } else {
        char *s = cJSON_PrintUnformatted(v); /* a number: JSON's form is Python's too */
        if (!s) return -1;
        loom_sbuf_str(b, s);
        free(s);
    }
    return 0;
}

/* A literal JSON value (enum/const member), compact. */
static void add_json_literal(js_t *j, int rule, const cJSON *v) {
    if (PY(j)) {
        loom_sbuf_t b = {0};
        loom_sbuf_add(&b, "", 0);
        if (py_literal(&b, v) < 0)
            js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: %s",
                    "a control character in an enum or const string "
                    "cannot be written as a Python literal");
        else {
            loom_gb_alt(j->gb, rule);
            loom_gb_add_lit(j->gb, rule, b.p, b.len);
        }
        free(b.p);
        return;
    }
    char *s = cJSON_PrintUnformatted(v);
    if (!s) {
        js_fail(j, LOOM_ERR_NOMEM, "json schema: %s", "out of memory");
        return;
    }
    loom_gb_alt(j->gb, rule);
    loom_gb_add_lit(j->gb, rule, s, strlen(s));
    free(s);
}

static int js_schema(js_t *j, const cJSON *s);

static const cJSON *resolve_ref(js_t *j, const char *ref) {
    if (ref[0] != '#') return NULL;
    const cJSON *cur = j->doc;
    const char *p = ref + 1;
    while (*p == '/') {
        p++;
        char tok[256];
        size_t k = 0;
        while (*p && *p != '/' && k + 1 < sizeof tok) {
            if (p[0] == '~' && p[1] == '0')
                tok[k++] = '~', p += 2;
            else if (p[0] == '~' && p[1] == '1')
                tok[k++] = '/', p += 2;
            else
                tok[k++] = *p++;
        }
        tok[k] = 0;
        if (cJSON_IsObject(cur))
            cur = cJSON_GetObjectItemCaseSensitive(cur, tok);
        else if (cJSON_IsArray(cur))
            cur = cJSON_GetArrayItem(cur, atoi(tok));
        else
            return NULL;
        if (!cur) return NULL;
    }
    return *p ? NULL : cur;
}

static int js_ref(js_t *j, const char *ref) {
    for (int i = 0; i < j->n_refs; i++)
        if (strcmp(j->refs[i].ref, ref) == 0) return j->refs[i].rule;
    const cJSON *target = resolve_ref(j, ref);
    if (!target)
        return js_fail(
            j, LOOM_ERR_INVALID_ARGUMENT,
            "json schema: $ref '%s' does not resolve (only local '#/...' references are supported)",
            ref);
    /* (a document after the first, as another tool's schema: its own names) */
    size_t cap = strlen(ref) + 16;
    char *name = loom_xmalloc(cap);
    if (j->doc_no)
        snprintf(name, cap, "%s@%d", ref, j->doc_no);
    else
        snprintf(name, cap, "%s", ref);
    int r = loom_gb_rule_named(j->gb, name, strlen(name));
    free(name);
    j->refs = loom_xrealloc(j->refs, (size_t)(j->n_refs + 1) * sizeof *j->refs);
    j->refs[j->n_refs].ref = loom_xstrdup(ref);
    j->refs[j->n_refs++].rule = r;
    int body = js_schema(j, target);
    if (j->st < 0) return -1;
    loom_gb_alt(j->gb, r);
    loom_gb_add_ref(j->gb, r, body);
    return r;
}

static int get_count(js_t *j, const cJSON *s, const char *key, int dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!v) return dflt;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != (double)(long)v->valuedouble)
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT,
                       "json schema: '%s' must be a non-negative integer", key),
               dflt;
    if (v->valuedouble > 4096)
        return js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: '%s' above 4096 is not supported",
                       key),
               dflt;
    return (int)v->valuedouble;
}

static void json_escape_lit(js_t *j, int rule, const char *name) {
    if (PY(j)) { /* a dict key */
        loom_sbuf_t b = {0};
        loom_sbuf_add(&b, "", 0);
        if (py_quote(&b, name) < 0)
            js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: %s",
                    "a control character in a property name "
                    "cannot be written as a Python literal");
        else
            loom_gb_add_lit(j->gb, rule, b.p, b.len);
        free(b.p);
        return;
    }
    loom_gb_add_byte(j->gb, rule, '"');
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        if (*p == '"' || *p == '\\') {
            loom_gb_add_byte(j->gb, rule, '\\');
            loom_gb_add_byte(j->gb, rule, *p);
        } else if (*p < 0x20) {
            char buf[8];
            snprintf(buf, sizeof buf, "\\u%04x", *p);
            loom_gb_add_lit(j->gb, rule, buf, 6);
        } else {
            loom_gb_add_byte(j->gb, rule, *p);
        }
    }
    loom_gb_add_byte(j->gb, rule, '"');
}

/* The members of an object: the pairs in order, the required ones always,
 * the others maybe left out, then any number of further pairs (ap; -1:
 * none), sep between two. */
static int members_rule(js_t *j, const int *pair, const int *required, int n, int ap, int sep) {
    /* S_i: pairs i.. after one was written; F_i: none written yet */
    int S = loom_gb_rule(j->gb, NULL), F = loom_gb_rule(j->gb, NULL);
    loom_gb_alt(j->gb, S);
    loom_gb_alt(j->gb, F);
    if (ap >= 0) {
        loom_gb_alt(j->gb, S);
        loom_gb_add_ref(j->gb, S, sep);
        loom_gb_add_ref(j->gb, S, ap);
        loom_gb_add_ref(j->gb, S, S);
        loom_gb_alt(j->gb, F);
        loom_gb_add_ref(j->gb, F, ap);
        loom_gb_add_ref(j->gb, F, S);
    }
    for (int k = n - 1; k >= 0; k--) {
        int S2 = loom_gb_rule(j->gb, NULL), F2 = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, S2);
        loom_gb_add_ref(j->gb, S2, sep);
        loom_gb_add_ref(j->gb, S2, pair[k]);
        loom_gb_add_ref(j->gb, S2, S);
        if (!required[k]) {
            loom_gb_alt(j->gb, S2);
            loom_gb_add_ref(j->gb, S2, S);
        }
        loom_gb_alt(j->gb, F2);
        loom_gb_add_ref(j->gb, F2, pair[k]);
        loom_gb_add_ref(j->gb, F2, S);
        if (!required[k]) {
            loom_gb_alt(j->gb, F2);
            loom_gb_add_ref(j->gb, F2, F);
        }
        S = S2;
        F = F2;
    }
    return F;
}

/* properties and required of an object schema, checked: 0, or -1 (j->st set). */
static int object_parts(js_t *j, const cJSON *s, const cJSON **props, const cJSON **req) {
    *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    if (*props && !cJSON_IsObject(*props))
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: '%s' must be an object",
                       "properties");
    if (*req && !cJSON_IsArray(*req))
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: '%s' must be an array",
                       "required");
    const cJSON *r;
    cJSON_ArrayForEach(r, *req) {
        if (!cJSON_IsString(r))
            return js_fail(j, LOOM_ERR_INVALID_ARGUMENT,
                           "json schema: '%s' entries must be strings", "required");
        if (!*props || !cJSON_GetObjectItemCaseSensitive(*props, r->valuestring))
            return js_fail(j, LOOM_ERR_UNSUPPORTED,
                           "json schema: required property '%s' is not in properties",
                           r->valuestring);
    }
    return 0;
}

static int is_required(const cJSON *req, const char *key) {
    const cJSON *r;
    cJSON_ArrayForEach(r, req) if (strcmp(r->valuestring, key) == 0) return 1;
    return 0;
}

static int js_object(js_t *j, const cJSON *s) {
    const cJSON *props, *req, *addl = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (object_parts(j, s, &props, &req) < 0) return -1;
    if (!props && !req && (!addl || cJSON_IsTrue(addl))) return rule_object_any(j);
    int n = props ? cJSON_GetArraySize(props) : 0;
    int ws = rule_ws(j);
    int extra = -1; /* value rule of additional properties */
    if (addl && !cJSON_IsFalse(addl)) {
        if (cJSON_IsTrue(addl))
            extra = rule_any_value(j);
        else if (cJSON_IsObject(addl))
            extra = js_schema(j, addl);
        else
            return js_fail(j, LOOM_ERR_INVALID_ARGUMENT,
                           "json schema: '%s' must be a boolean or a schema",
                           "additionalProperties");
        if (j->st < 0) return -1;
    }
    /* pair rules */
    int *pair = loom_xcalloc((size_t)n + 1, sizeof *pair);
    int *required = loom_xcalloc((size_t)n + 1, sizeof *required);
    int i = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, props) {
        int val = js_schema(j, p);
        if (j->st < 0) break;
        int pr = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, pr);
        json_escape_lit(j, pr, p->string);
        loom_gb_add_ref(j->gb, pr, ws);
        loom_gb_add_byte(j->gb, pr, ':');
        loom_gb_add_ref(j->gb, pr, ws);
        loom_gb_add_ref(j->gb, pr, val);
        loom_gb_add_ref(j->gb, pr, ws);
        pair[i] = pr;
        required[i++] = is_required(req, p->string);
    }
    int result = -1;
    if (j->st >= 0) {
        int ap = -1; /* a further pair */
        if (extra >= 0) {
            ap = loom_gb_rule(j->gb, NULL);
            loom_gb_alt(j->gb, ap);
            loom_gb_add_ref(j->gb, ap, rule_any_string(j));
            loom_gb_add_ref(j->gb, ap, ws);
            loom_gb_add_byte(j->gb, ap, ':');
            loom_gb_add_ref(j->gb, ap, ws);
            loom_gb_add_ref(j->gb, ap, extra);
            loom_gb_add_ref(j->gb, ap, ws);
        }
        int sep = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, sep);
        loom_gb_add_byte(j->gb, sep, ',');
        loom_gb_add_ref(j->gb, sep, ws);
        result = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, result);
        loom_gb_add_byte(j->gb, result, '{');
        loom_gb_add_ref(j->gb, result, ws);
        loom_gb_add_ref(j->gb, result, members_rule(j, pair, required, n, ap, sep));
        loom_gb_add_byte(j->gb, result, '}');
    }
    free(pair);
    free(required);
    return result;
}

static int js_format(js_t *j, const char *fmt) {
    static const char DATE[] = "[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])";
    static const char TIME[] = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[-+](["
                               "01][0-9]|2[0-3]):[0-5][0-9])";
    char re[512];
    if (strcmp(fmt, "date") == 0)
        snprintf(re, sizeof re, "%s", DATE);
    else if (strcmp(fmt, "time") == 0)
        snprintf(re, sizeof re, "%s", TIME);
    else if (strcmp(fmt, "date-time") == 0)
        snprintf(re, sizeof re, "%sT%s", DATE, TIME);
    else if (strcmp(fmt, "uuid") == 0)
        snprintf(re, sizeof re, "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}");
    else if (strcmp(fmt, "email") == 0)
        snprintf(re, sizeof re,
                 "[a-zA-Z0-9_]+(\\.[a-zA-Z0-9_]+)*@[a-zA-Z0-9]+(\\.[a-zA-Z0-9]+)*\\.[a-zA-Z]{2,8}");
    else
        return js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: unsupported string format '%s'", fmt);
    return js_regex(j, re, 1);
}

static int js_string(js_t *j, const cJSON *s) {
    int min = get_count(j, s, "minLength", 0), max = get_count(j, s, "maxLength", -1);
    if (j->st < 0) return -1;
    if (max >= 0 && min > max)
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                       "minLength > maxLength");
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(s, "pattern");
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
    if ((pat || fmt) && (min > 0 || max >= 0))
        return js_fail(j, LOOM_ERR_UNSUPPORTED,
                       "json schema: %s together with minLength/maxLength is not supported",
                       pat ? "pattern" : "format");
    if (pat && fmt)
        return js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: %s is not supported",
                       "pattern together with format");
    int body = -1;
    if (pat) {
        if (!cJSON_IsString(pat))
            return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: '%s' must be a string",
                           "pattern");
        /* JSON Schema patterns search: unanchored ends match anything */
        const char *p = pat->valuestring;
        size_t n = strlen(p);
        int a0 = n > 0 && p[0] == '^';
        int a1 = n > 0 && p[n - 1] == '$' && (n < 2 || p[n - 2] != '\\');
        if (a0) p++, n--;
        if (a1 && n > 0) n--;
        char *re = loom_xmalloc(n + 32);
        snprintf(re, n + 32, "%s(?:%.*s)%s", a0 ? "" : ".*", (int)n, p, a1 ? "" : ".*");
        body = js_regex(j, re, 1);
        free(re);
    } else if (fmt) {
        if (!cJSON_IsString(fmt))
            return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: '%s' must be a string",
                           "format");
        body = js_format(j, fmt->valuestring);
    } else {
        if (min == 0 && max < 0) return rule_any_string(j);
        return rule_string(j, min, max);
    }
    if (j->st < 0) return -1;
    int r = loom_gb_rule(j->gb, NULL);
    loom_gb_alt(j->gb, r);
    loom_gb_add_byte(j->gb, r, '"');
    loom_gb_add_ref(j->gb, r, body);
    loom_gb_add_byte(j->gb, r, '"');
    return r;
}

static int js_array(js_t *j, const cJSON *s) {
    int min = get_count(j, s, "minItems", 0), max = get_count(j, s, "maxItems", -1);
    if (j->st < 0) return -1;
    if (max >= 0 && min > max)
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                       "minItems > maxItems");
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    int item;
    if (!items || cJSON_IsTrue(items))
        item = rule_any_value(j);
    else if (cJSON_IsFalse(items)) {
        if (min > 0)
            return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                           "items false with minItems > 0");
        max = 0;
        item = rule_any_value(j);
    } else if (cJSON_IsObject(items))
        item = js_schema(j, items);
    else
        return js_fail(j, LOOM_ERR_UNSUPPORTED,
                       "json schema: '%s' must be a schema (tuple form is not supported)", "items");
    if (j->st < 0) return -1;
    return rule_array_of(j, item, min, max);
}

static int js_type(js_t *j, const cJSON *s, const char *t) {
    if (strcmp(t, "object") == 0) return js_object(j, s);
    if (strcmp(t, "array") == 0) return js_array(j, s);
    if (strcmp(t, "string") == 0) return js_string(j, s);
    if (strcmp(t, "number") == 0) return rule_number(j);
    if (strcmp(t, "integer") == 0) return rule_integer(j);
    int r = loom_gb_rule(j->gb, NULL);
    if (strcmp(t, "boolean") == 0) {
        loom_gb_alt(j->gb, r);
        loom_gb_add_lit(j->gb, r, PY(j) ? "True" : "true", 4);
        loom_gb_alt(j->gb, r);
        loom_gb_add_lit(j->gb, r, PY(j) ? "False" : "false", 5);
        return r;
    }
    if (strcmp(t, "null") == 0) {
        loom_gb_alt(j->gb, r);
        loom_gb_add_lit(j->gb, r, PY(j) ? "None" : "null", 4);
        return r;
    }
    return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: unknown type '%s'", t);
}

static int js_schema(js_t *j, const cJSON *s) {
    if (j->st < 0) return -1;
    if (cJSON_IsTrue(s)) return rule_any_value(j);
    if (cJSON_IsFalse(s))
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                       "schema false");
    if (!cJSON_IsObject(s))
        return js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s",
                       "a schema must be an object or a boolean");
    if (++j->depth > 64)
        return js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: %s", "nested deeper than 64 levels");
    int result = -1;
    const cJSON *k;
    cJSON_ArrayForEach(k, s) {
        int known = 0;
        for (int i = 0; KNOWN[i]; i++)
            known |= strcmp(KNOWN[i], k->string) == 0;
        if (!known) {
            js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: unsupported keyword '%s'", k->string);
            goto out;
        }
    }
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    if (!any) any = cJSON_GetObjectItemCaseSensitive(s, "oneOf");
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(s, "allOf");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (ref) {
        if (!cJSON_IsString(ref)) {
            js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: '%s' must be a string", "$ref");
            goto out;
        }
        result = js_ref(j, ref->valuestring);
    } else if (cn) {
        result = loom_gb_rule(j->gb, NULL);
        add_json_literal(j, result, cn);
    } else if (en) {
        if (!cJSON_IsArray(en) || cJSON_GetArraySize(en) == 0) {
            js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                    "enum must be a non-empty array");
            goto out;
        }
        result = loom_gb_rule(j->gb, NULL);
        const cJSON *v;
        cJSON_ArrayForEach(v, en) add_json_literal(j, result, v);
    } else if (any) {
        if (!cJSON_IsArray(any) || cJSON_GetArraySize(any) == 0) {
            js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                    "anyOf/oneOf must be a non-empty array");
            goto out;
        }
        result = loom_gb_rule(j->gb, NULL);
        const cJSON *v;
        cJSON_ArrayForEach(v, any) {
            int b = js_schema(j, v);
            if (j->st < 0) goto out;
            loom_gb_alt(j->gb, result);
            loom_gb_add_ref(j->gb, result, b);
        }
    } else if (all) {
        if (!cJSON_IsArray(all) || cJSON_GetArraySize(all) != 1) {
            js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: %s",
                    "allOf with more than one schema is not supported");
            goto out;
        }
        result = js_schema(j, cJSON_GetArrayItem(all, 0));
    } else if (cJSON_IsString(type)) {
        result = js_type(j, s, type->valuestring);
    } else if (cJSON_IsArray(type)) {
        if (cJSON_GetArraySize(type) == 0) {
            js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s (unsatisfiable)",
                    "empty type list");
            goto out;
        }
        result = loom_gb_rule(j->gb, NULL);
        const cJSON *t;
        cJSON_ArrayForEach(t, type) {
            if (!cJSON_IsString(t)) {
                js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s",
                        "type entries must be strings");
                goto out;
            }
            int b = js_type(j, s, t->valuestring);
            if (j->st < 0) goto out;
            loom_gb_alt(j->gb, result);
            loom_gb_add_ref(j->gb, result, b);
        }
    } else if (type) {
        js_fail(j, LOOM_ERR_INVALID_ARGUMENT, "json schema: %s",
                "'type' must be a string or an array");
    } else if (cJSON_GetObjectItemCaseSensitive(s, "properties") ||
               cJSON_GetObjectItemCaseSensitive(s, "required")) {
        result = js_object(j, s);
    } else if (cJSON_GetObjectItemCaseSensitive(s, "items")) {
        result = js_array(j, s);
    } else {
        result = rule_any_value(j);
    }
out:
    j->depth--;
    return j->st < 0 ? -1 : result;
}

static void js_init(js_t *j, loom_gb_t *gb, loom_err_t *err) {
    memset(j, 0, sizeof *j);
    j->gb = gb;
    j->err = err;
    j->ws = j->value = j->string = j->number = j->integer = -1;
    j->object_any = j->array_any = j->member_any = -1;
}

static loom_status_t js_finish(js_t *j, int body, loom_grammar_t **out) {
    for (int i = 0; i < j->n_refs; i++)
        free(j->refs[i].ref);
    free(j->refs);
    if (j->st < 0) {
        loom_gb_destroy(&j->gb);
        return j->st;
    }
    /* root ::= body */
    int root = loom_gb_rule(j->gb, "root");
    loom_gb_alt(j->gb, root);
    loom_gb_add_ref(j->gb, root, body);
    return loom_gb_finish(&j->gb, root, out, j->err);
}

loom_status_t loom_grammar_compile_json_schema(const char *schema, size_t len, loom_grammar_t **out,
                                               loom_err_t *err) {
    size_t bad = 0;
    cJSON *doc = loom_json_parse_strict(schema, len, &bad);
    if (!doc)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "json schema: not valid JSON (at byte %zu)", bad);
    js_t j;
    js_init(&j, loom_gb_create(), err);
    j.doc = doc;
    int body = js_schema(&j, doc);
    loom_status_t st = js_finish(&j, body, out);
    cJSON_Delete(doc);
    return st;
}

loom_status_t loom_grammar_compile_json_object(loom_grammar_t **out, loom_err_t *err) {
    js_t j;
    js_init(&j, loom_gb_create(), err);
    int body = rule_object_any(&j);
    return js_finish(&j, body, out);
}

loom_status_t loom_grammar_compile_choice(const char *json_array, size_t len, loom_grammar_t **out,
                                          loom_err_t *err) {
    size_t bad = 0;
    cJSON *doc = loom_json_parse_strict(json_array, len, &bad);
    if (!doc)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "guided_choice: not valid JSON (at byte %zu)", bad);
    loom_status_t st = LOOM_OK;
    if (!cJSON_IsArray(doc) || cJSON_GetArraySize(doc) == 0)
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "guided_choice: must be a non-empty array of strings");
    loom_gb_t *gb = loom_gb_create();
    int root = loom_gb_rule(gb, "root");
    const cJSON *v;
    cJSON_ArrayForEach(v, doc) {
        if (st < 0) break;
        if (!cJSON_IsString(v)) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "guided_choice: must be a non-empty array of strings");
            break;
        }
        loom_gb_alt(gb, root);
        loom_gb_add_lit(gb, root, v->valuestring, strlen(v->valuestring));
    }
    cJSON_Delete(doc);
    if (st < 0) {
        loom_gb_destroy(&gb);
        return st;
    }
    return loom_gb_finish(&gb, root, out, err);
}

/* ---- Values inside other markup (grammar_impl.h, the tool-call grammars) */

loom_js_t *loom_js_create(loom_gb_t *gb, loom_js_syntax_t syntax, int no_lt, loom_err_t *err) {
    js_t *j = loom_xmalloc(sizeof *j);
    js_init(j, gb, err);
    j->syntax = syntax;
    j->no_lt = no_lt;
    return j;
}

void loom_js_destroy(loom_js_t **j_p) {
    if (!j_p || !*j_p) return;
    js_t *j = *j_p;
    for (int i = 0; i < j->n_refs; i++)
        free(j->refs[i].ref);
    free(j->refs);
    free(j);
    *j_p = NULL;
}

loom_status_t loom_js_status(const loom_js_t *j) {
    return j->st;
}

int loom_js_fail(loom_js_t *j, loom_status_t code, const char *fmt, const char *arg) {
    return js_fail(j, code, fmt, arg);
}

/* $refs resolve inside doc: a new document starts a new table of them. */
static void js_doc(js_t *j, const cJSON *doc) {
    if (doc == j->doc) return;
    if (j->doc) j->doc_no++;
    for (int i = 0; i < j->n_refs; i++)
        free(j->refs[i].ref);
    j->n_refs = 0;
    j->doc = doc;
}

int loom_js_schema(loom_js_t *j, const cJSON *doc, const cJSON *schema) {
    js_doc(j, doc);
    return js_schema(j, schema);
}

int loom_js_members(loom_js_t *j, const cJSON *doc, const loom_js_members_t *style) {
    js_doc(j, doc);
    if (j->st < 0) return -1;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(doc, "type");
    if (!cJSON_IsObject(doc) ||
        (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "object") != 0)))
        return js_fail(j, LOOM_ERR_UNSUPPORTED, "json schema: %s",
                       "the parameters must be an object schema");
    const cJSON *props, *req;
    if (object_parts(j, doc, &props, &req) < 0) return -1;
    int n = props ? cJSON_GetArraySize(props) : 0;
    int *pair = loom_xcalloc((size_t)n + 1, sizeof *pair);
    int *required = loom_xcalloc((size_t)n + 1, sizeof *required);
    int i = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, props) {
        int val = style->value ? style->value(j, p->string, p, style->ctx) : js_schema(j, p);
        if (j->st < 0) break;
        int pr = loom_gb_rule(j->gb, NULL);
        loom_gb_alt(j->gb, pr);
        loom_gb_add_lit(j->gb, pr, style->pre, strlen(style->pre));
        loom_gb_add_lit(j->gb, pr, p->string, strlen(p->string));
        loom_gb_add_lit(j->gb, pr, style->mid, strlen(style->mid));
        loom_gb_add_ref(j->gb, pr, val);
        loom_gb_add_lit(j->gb, pr, style->post, strlen(style->post));
        pair[i] = pr;
        required[i++] = is_required(req, p->string);
    }
    int result = -1;
    if (j->st >= 0)
        result = members_rule(j, pair, required, n, -1,
                              loom_gb_lit_rule(j->gb, style->sep, strlen(style->sep)));
    free(pair);
    free(required);
    return result;
}

/* The marked call syntaxes read from the whole text (tool_parsers.h):
 * DeepSeek V3 / V3.1's marked blocks, the pythonic call list, Qwen3-Coder's
 * blocks and GPT-OSS's harmony calls. */
#include "gateway/tool_parsers.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"


int loom_tp_held(loom_toolfmt_t f) {
    return f == LOOM_TOOLFMT_DEEPSEEK_V3 || f == LOOM_TOOLFMT_DEEPSEEK_V31 ||
           f == LOOM_TOOLFMT_PYTHONIC || f == LOOM_TOOLFMT_LLAMA4_PYTHONIC ||
           f == LOOM_TOOLFMT_QWEN3_CODER || f == LOOM_TOOLFMT_OPENAI;
}

/* Harmony's call headers: GPT-OSS writes the recipient before or after the
 * channel, the message start (HM_START) maybe before both. */
#define HM_START "<|start|>assistant"
static const char *const k_hm_marks[] = {
    "to=functions.", " to=functions.", "<|channel|>commentary to=functions.",
    HM_START " to=functions.", HM_START "<|channel|>commentary to=functions."};

/* Longest suffix of text[0..len) that is a proper prefix of m. */
static size_t prefix_tail(const char *text, size_t len, const char *m) {
    size_t n = strlen(m);
    for (size_t l = n - 1 < len ? n - 1 : len; l > 0; l--)
        if (!memcmp(text + len - l, m, l)) return l;
    return 0;
}

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

size_t loom_tp_find_start(loom_toolfmt_t f, const char *text, size_t len, size_t *maybe) {
    *maybe = 0;
    if (f == LOOM_TOOLFMT_PYTHONIC || f == LOOM_TOOLFMT_LLAMA4_PYTHONIC) { /* the answer itself */
        static const char tag[] = "<|python_start|>";
        size_t i = 0, t = f == LOOM_TOOLFMT_LLAMA4_PYTHONIC ? sizeof tag - 1 : 0;
        while (i < len && is_space(text[i]))
            i++;
        if (i < len && t &&
            !memcmp(text + i, tag, LOOM_MIN(t, len - i))) { /* (a prefix of) the tag */
            if (len - i < t) {
                *maybe = len;
                return len;
            }
            return 0;
        }
        if (i == len) {
            *maybe = len;
            return len;
        }
        return text[i] == '['
                   ? 0
                   : len; /* held from the start: the whitespace too, content if not calls */
    }
    if (f == LOOM_TOOLFMT_OPENAI) { /* "to=functions.", from the header's start */
        const char *p = memmem(text, len, k_hm_marks[0], strlen(k_hm_marks[0]));
        if (p) {
            size_t at = (size_t)(p - text), best = at;
            for (size_t k = 1; k < LOOM_ARRAY_LEN(k_hm_marks); k++) {
                size_t back = strlen(k_hm_marks[k]) - strlen(k_hm_marks[0]);
                if (at >= back && !memcmp(text + at - back, k_hm_marks[k], back) &&
                    at - back < best)
                    best = at - back;
            }
            return best;
        }
        for (size_t k = 0; k < LOOM_ARRAY_LEN(k_hm_marks); k++) {
            size_t l = prefix_tail(text, len, k_hm_marks[k]);
            if (l > *maybe) *maybe = l;
        }
        return len;
    }
    const char *m = f == LOOM_TOOLFMT_QWEN3_CODER ? "<tool_call>" : DS_CALLS_BEGIN;
    size_t n = strlen(m);
    const char *p = memmem(text, len, m, n);
    if (p) return (size_t)(p - text);
    for (size_t l = n - 1 < len ? n - 1 : len; l > 0; l--)
        if (!memcmp(text + len - l, m, l)) {
            *maybe = l;
            break;
        }
    return len;
}

void loom_tp_calls_free(loom_tp_call_t *calls, int n) {
    for (int i = 0; i < n; i++) {
        free(calls[i].name);
        free(calls[i].args);
    }
    free(calls);
}

static int known(const cJSON *tools, const char *name, size_t n) {
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
        if (cJSON_IsString(nm) && strlen(nm->valuestring) == n && !memcmp(nm->valuestring, name, n))
            return 1;
    }
    return 0;
}

static char *dup_n(const char *s, size_t n) {
    char *d = loom_xmalloc(n + 1);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* A JSON value's text less the whitespace between tokens (an object unless
 * any); NULL when it is not one such value. */
static char *compact_json(const char *s, size_t n, int any) {
    char *copy = dup_n(s, n);
    cJSON *o = cJSON_Parse(copy);
    int ok = o && (any || cJSON_IsObject(o));
    cJSON_Delete(o);
    if (!ok) {
        free(copy);
        return NULL;
    }
    size_t k = 0;
    int in_str = 0, esc = 0;
    for (size_t i = 0; i < n; i++) {
        char c = copy[i];
        if (in_str) {
            if (esc)
                esc = 0;
            else if (c == '\\')
                esc = 1;
            else if (c == '"')
                in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else if (is_space(c)) {
            continue;
        }
        copy[k++] = c;
    }
    copy[k] = 0;
    return copy;
}

static int starts(const char *s, size_t n, size_t at, const char *lit) {
    size_t l = strlen(lit);
    return at + l <= n && !memcmp(s + at, lit, l);
}

static size_t skip_ws(const char *s, size_t n, size_t i) {
    while (i < n && is_space(s[i]))
        i++;
    return i;
}

static void add_call(loom_tp_call_t **calls, int *nc, char *name, char *args) {
    *calls = loom_xrealloc(*calls, (size_t)(*nc + 1) * sizeof **calls);
    (*calls)[*nc].name = name;
    (*calls)[*nc].args = args;
    (*nc)++;
}

static int parse_deepseek(int v31, const cJSON *tools, const char *s, size_t n,
                          loom_tp_call_t **calls, size_t *end) {
    size_t i = strlen(DS_CALLS_BEGIN);
    int nc = 0;
    for (;;) {
        i = skip_ws(s, n, i);
        if (starts(s, n, i, DS_CALLS_END)) {
            *end = i + strlen(DS_CALLS_END);
            break;
        }
        if (!starts(s, n, i, DS_CALL_BEGIN)) goto fail;
        i += strlen(DS_CALL_BEGIN);
        const char *sep = memmem(s + i, n - i, DS_SEP, strlen(DS_SEP));
        const char *close = memmem(s + i, n - i, DS_CALL_END, strlen(DS_CALL_END));
        if (!sep || !close || sep > close) goto fail;
        size_t name_at, name_len, args_at, args_len;
        if (v31) { /* NAME<sep>ARGS<end> */
            name_at = i;
            name_len = (size_t)(sep - s) - i;
            args_at = (size_t)(sep - s) + strlen(DS_SEP);
            args_len = (size_t)(close - s) - args_at;
        } else { /* TYPE<sep>NAME\n```json\nARGS\n```<end> */
            size_t after = (size_t)(sep - s) + strlen(DS_SEP);
            const char *fence = memmem(s + after, (size_t)(close - s) - after, "\n```json\n", 9);
            if (!fence || (size_t)(close - s) < 4 || memcmp(close - 4, "\n```", 4) != 0 ||
                fence + 9 > close - 4)
                goto fail;
            name_at = after;
            name_len = (size_t)(fence - s) - after;
            args_at = (size_t)(fence - s) + 9;
            args_len = (size_t)(close - 4 - s) - args_at;
        }
        while (name_len && is_space(s[name_at + name_len - 1]))
            name_len--;
        while (name_len && is_space(s[name_at]))
            name_at++, name_len--;
        if (!known(tools, s + name_at, name_len)) goto fail;
        char *args = compact_json(s + args_at, args_len, 0);
        if (!args) goto fail;
        add_call(calls, &nc, dup_n(s + name_at, name_len), args);
        i = (size_t)(close - s) + strlen(DS_CALL_END);
    }
    return nc ? nc : -1;
fail:
    loom_tp_calls_free(*calls, nc);
    *calls = NULL;
    return -1;
}

/* ---- pythonic: Python literals to JSON ---- */

typedef struct {
    const char *s;
    size_t n, i;
    int depth;
} py_t;

static int py_value(py_t *p, loom_sbuf_t *out);

static int py_string(py_t *p, loom_sbuf_t *out) {
    char q = p->s[p->i++];
    loom_sbuf_t raw = {0};
    loom_sbuf_add(&raw, "", 0);
    while (p->i < p->n && p->s[p->i] != q) {
        char c = p->s[p->i++];
        if (c == '\n') break;
        if (c == '\\' && p->i < p->n) {
            char e = p->s[p->i++];
            switch (e) {
            case 'n':
                c = '\n';
                break;
            case 'r':
                c = '\r';
                break;
            case 't':
                c = '\t';
                break;
            case '\\':
            case '\'':
            case '"':
                c = e;
                break;
            default: /* kept as written */
                loom_sbuf_add(&raw, "\\", 1);
                c = e;
            }
        }
        loom_sbuf_add(&raw, &c, 1);
    }
    if (p->i >= p->n || p->s[p->i] != q) {
        free(raw.p);
        return -1;
    }
    p->i++;
    cJSON *str = cJSON_CreateString(raw.p);
    char *js = cJSON_PrintUnformatted(str);
    cJSON_Delete(str);
    free(raw.p);
    if (!js) return -1;
    loom_sbuf_str(out, js);
    free(js);
    return 0;
}

static int py_number(py_t *p, loom_sbuf_t *out) {
    size_t a = p->i;
    if (p->s[p->i] == '-' || p->s[p->i] == '+') p->i++;
    size_t digits = 0, frac = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9')
        p->i++, digits++;
    int dot = p->i < p->n && p->s[p->i] == '.';
    if (dot) {
        p->i++;
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9')
            p->i++, frac++;
    }
    if (!digits && !frac) return -1;
    size_t exp_at = p->i;
    if (p->i < p->n && (p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
        p->i++;
        if (p->i < p->n && (p->s[p->i] == '+' || p->s[p->i] == '-')) p->i++;
        size_t e = 0;
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9')
            p->i++, e++;
        if (!e) return -1;
    }
    /* as JSON: no '+', digits on both sides of a '.', no leading zeros beyond one */
    if (p->s[a] == '-') loom_sbuf_add(out, "-", 1);
    size_t k = a + (p->s[a] == '-' || p->s[a] == '+');
    while (digits > 1 && p->s[k] == '0')
        k++, digits--;
    if (digits)
        loom_sbuf_add(out, p->s + k, digits);
    else
        loom_sbuf_add(out, "0", 1);
    if (dot) {
        loom_sbuf_add(out, ".", 1);
        if (frac)
            loom_sbuf_add(out, p->s + k + digits + 1, frac);
        else
            loom_sbuf_add(out, "0", 1);
    }
    loom_sbuf_add(out, p->s + exp_at, p->i - exp_at);
    return 0;
}

static void py_ws(py_t *p) {
    p->i = skip_ws(p->s, p->n, p->i);
}

/* [a, b] / (a, b) / {k: v}: close is the closing bracket */
static int py_seq(py_t *p, loom_sbuf_t *out, char close, int dict) {
    p->i++;
    loom_sbuf_add(out, dict ? "{" : "[", 1);
    py_ws(p);
    int first = 1;
    while (p->i < p->n && p->s[p->i] != close) {
        if (!first) {
            if (p->s[p->i] != ',') return -1;
            p->i++;
            py_ws(p);
            if (p->i < p->n && p->s[p->i] == close) break; /* a trailing comma */
            loom_sbuf_add(out, ",", 1);
        }
        first = 0;
        if (dict) {
            if (p->i >= p->n || (p->s[p->i] != '"' && p->s[p->i] != '\'') || py_string(p, out) < 0)
                return -1;
            py_ws(p);
            if (p->i >= p->n || p->s[p->i] != ':') return -1;
            p->i++;
            py_ws(p);
            loom_sbuf_add(out, ":", 1);
        }
        if (py_value(p, out) < 0) return -1;
        py_ws(p);
    }
    if (p->i >= p->n) return -1;
    p->i++;
    loom_sbuf_add(out, dict ? "}" : "]", 1);
    return 0;
}

static int py_value(py_t *p, loom_sbuf_t *out) {
    if (p->i >= p->n || ++p->depth > 32) return -1;
    char c = p->s[p->i];
    int rc;
    if (c == '"' || c == '\'')
        rc = py_string(p, out);
    else if (c == '[')
        rc = py_seq(p, out, ']', 0);
    else if (c == '(')
        rc = py_seq(p, out, ')', 0);
    else if (c == '{')
        rc = py_seq(p, out, '}', 1);
    else if (starts(p->s, p->n, p->i, "True"))
        p->i += 4, loom_sbuf_str(out, "true"), rc = 0;
    else if (starts(p->s, p->n, p->i, "False"))
        p->i += 5, loom_sbuf_str(out, "false"), rc = 0;
    else if (starts(p->s, p->n, p->i, "None"))
        p->i += 4, loom_sbuf_str(out, "null"), rc = 0;
    else
        rc = py_number(p, out);
    p->depth--;
    return rc;
}

int loom_tp_py_literal(const char *s, size_t n, loom_sbuf_t *out) {
    py_t p = {.s = s, .n = n, .i = 0};
    loom_sbuf_t v = {0};
    int rc = py_value(&p, &v) < 0 || p.i != n ? -1 : 0;
    if (!rc) loom_sbuf_add(out, v.p, v.len);
    free(v.p);
    return rc;
}

static int is_ident(char c, int first) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (!first && ((c >= '0' && c <= '9') || c == '.' || c == '-'));
}

static int parse_pythonic(const cJSON *tools, const char *s, size_t n, loom_tp_call_t **calls,
                          size_t *end) {
    py_t p = {.s = s, .n = n, .i = 0};
    int nc = 0;
    loom_sbuf_t args = {0};
    py_ws(&p);
    if (p.i >= n || s[p.i] != '[') return -1;
    p.i++;
    py_ws(&p);
    while (p.i < n && s[p.i] != ']') {
        if (nc) {
            if (s[p.i] != ',') goto fail;
            p.i++;
            py_ws(&p);
        }
        size_t name_at = p.i;
        while (p.i < n && is_ident(s[p.i], p.i == name_at))
            p.i++;
        size_t name_len = p.i - name_at;
        py_ws(&p);
        if (!name_len || p.i >= n || s[p.i] != '(' || !known(tools, s + name_at, name_len))
            goto fail;
        p.i++;
        py_ws(&p);
        args = (loom_sbuf_t){0};
        loom_sbuf_add(&args, "{", 1);
        int k = 0;
        while (p.i < n && s[p.i] != ')') {
            if (k) {
                if (s[p.i] != ',') goto fail;
                p.i++;
                py_ws(&p);
                if (p.i < n && s[p.i] == ')') break;
                loom_sbuf_add(&args, ",", 1);
            }
            size_t kw = p.i;
            while (p.i < n && is_ident(s[p.i], p.i == kw) && s[p.i] != '.' && s[p.i] != '-')
                p.i++;
            if (p.i == kw) goto fail; /* positional arguments are not calls (as vLLM) */
            cJSON *key = cJSON_CreateString("");
            char *kname = dup_n(s + kw, p.i - kw);
            cJSON_SetValuestring(key, kname);
            free(kname);
            char *kj = cJSON_PrintUnformatted(key);
            cJSON_Delete(key);
            loom_sbuf_str(&args, kj ? kj : "\"\"");
            free(kj);
            py_ws(&p);
            if (p.i >= n || s[p.i] != '=') goto fail;
            p.i++;
            py_ws(&p);
            loom_sbuf_add(&args, ":", 1);
            if (py_value(&p, &args) < 0) goto fail;
            py_ws(&p);
            k++;
        }
        if (p.i >= n) goto fail;
        p.i++;
        py_ws(&p);
        loom_sbuf_add(&args, "}", 1);
        add_call(calls, &nc, dup_n(s + name_at, name_len), args.p);
        args = (loom_sbuf_t){0};
    }
    if (p.i >= n || !nc) goto fail;
    p.i++;
    if (skip_ws(s, n, p.i) != n) goto fail; /* the list is the whole answer */
    *end = n;
    return nc;
fail:
    free(args.p);
    loom_tp_calls_free(*calls, nc);
    *calls = NULL;
    return -1;
}

/* ---- qwen3_coder: XML-like blocks, values typed by the tool's schema ---- */

static const cJSON *tool_params(const cJSON *tools, const char *name, size_t n) {
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (cJSON_IsString(nm) && strlen(nm->valuestring) == n && !memcmp(nm->valuestring, name, n))
            return cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    }
    return NULL;
}

void loom_tp_coder_value(const cJSON *params, const char *key, const char *v, size_t n,
                         loom_sbuf_t *out) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(params, "properties");
    const cJSON *type =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(props, key), "type");
    const char *ty = cJSON_IsString(type) ? type->valuestring : "string";
    char *text = dup_n(v, n);
    if (strcmp(ty, "string") != 0) { /* integer, number, boolean, object, array: JSON if it reads */
        cJSON *j = cJSON_Parse(text);
        int ok = 0;
        if (!strcmp(ty, "integer") || !strcmp(ty, "number"))
            ok = cJSON_IsNumber(j);
        else if (!strcmp(ty, "boolean"))
            ok = cJSON_IsBool(j);
        else if (!strcmp(ty, "object"))
            ok = cJSON_IsObject(j);
        else if (!strcmp(ty, "array"))
            ok = cJSON_IsArray(j);
        else
            ok = j != NULL;
        cJSON_Delete(j);
        char *c = ok ? compact_json(text, n, 1) : NULL;
        if (c) {
            loom_sbuf_str(out, c);
            free(c);
            free(text);
            return;
        }
    }
    cJSON *s = cJSON_CreateString(text);
    char *js = cJSON_PrintUnformatted(s);
    cJSON_Delete(s);
    loom_sbuf_str(out, js ? js : "\"\"");
    free(js);
    free(text);
}

static int parse_coder(const cJSON *tools, const char *s, size_t n, loom_tp_call_t **calls,
                       size_t *end) {
    size_t i = 0;
    int nc = 0;
    loom_sbuf_t args = {0};
    for (;;) {
        i = skip_ws(s, n, i);
        if (!starts(s, n, i, "<tool_call>")) break;
        i = skip_ws(s, n, i + strlen("<tool_call>"));
        if (!starts(s, n, i, "<function=")) goto fail;
        i += strlen("<function=");
        const char *gt = memchr(s + i, '>', n - i);
        if (!gt) goto fail;
        size_t name_at = i, name_len = (size_t)(gt - s) - i;
        if (!known(tools, s + name_at, name_len)) goto fail;
        const cJSON *params = tool_params(tools, s + name_at, name_len);
        i = (size_t)(gt - s) + 1;
        args = (loom_sbuf_t){0};
        loom_sbuf_add(&args, "{", 1);
        int k = 0;
        for (;;) {
            i = skip_ws(s, n, i);
            if (!starts(s, n, i, "<parameter=")) break;
            i += strlen("<parameter=");
            const char *kg = memchr(s + i, '>', n - i);
            if (!kg) goto fail;
            char *key = dup_n(s + i, (size_t)(kg - s) - i);
            i = (size_t)(kg - s) + 1;
            const char *close = memmem(s + i, n - i, "</parameter>", strlen("</parameter>"));
            if (!close) {
                free(key);
                goto fail;
            }
            size_t va = i, vb = (size_t)(close - s);
            if (va < vb && s[va] == '\n') va++; /* the value sits on lines of its own */
            if (vb > va && s[vb - 1] == '\n') vb--;
            cJSON *kj = cJSON_CreateString(key);
            char *ks = cJSON_PrintUnformatted(kj);
            cJSON_Delete(kj);
            if (k++) loom_sbuf_add(&args, ",", 1);
            loom_sbuf_str(&args, ks ? ks : "\"\"");
            loom_sbuf_add(&args, ":", 1);
            free(ks);
            loom_tp_coder_value(params, key, s + va, vb - va, &args);
            free(key);
            i = (size_t)(close - s) + strlen("</parameter>");
        }
        if (!starts(s, n, i, "</function>")) goto fail;
        i = skip_ws(s, n, i + strlen("</function>"));
        if (!starts(s, n, i, "</tool_call>")) goto fail;
        i += strlen("</tool_call>");
        loom_sbuf_add(&args, "}", 1);
        add_call(calls, &nc, dup_n(s + name_at, name_len), args.p);
        args = (loom_sbuf_t){0};
    }
    if (!nc) goto fail;
    *end = i;
    return nc;
fail:
    free(args.p);
    loom_tp_calls_free(*calls, nc);
    *calls = NULL;
    return -1;
}

/* ---- openai: GPT-OSS harmony messages on the commentary channel ---- */

/* Whether s[i, n) is a proper prefix of lit (the text may go on to be it). */
static int cut_short(const char *s, size_t n, size_t i, const char *lit) {
    return n - i < strlen(lit) && !memcmp(s + i, lit, n - i);
}

int loom_tp_harmony_header(const char *s, size_t n, size_t *at, size_t *name_at, size_t *name_len) {
    static const char *const words[] = {"<|message|>", "to=functions.", "<|channel|>commentary",
                                        "<|constrain|>", HM_START};
    size_t i = skip_ws(s, n, *at);
    int chan = 0;
    *name_len = 0;
    if (starts(s, n, i, HM_START)) i += strlen(HM_START);
    for (;;) {
        i = skip_ws(s, n, i);
        if (i == n) return -1;
        if (starts(s, n, i, "<|message|>")) break;
        if (starts(s, n, i, "to=functions.")) {
            i += strlen("to=functions.");
            *name_at = i;
            while (i < n && s[i] != '<' && !is_space(s[i]))
                i++;
            if (i == n) return -1;
            *name_len = i - *name_at;
        } else if (starts(s, n, i, "<|channel|>commentary")) {
            i += strlen("<|channel|>commentary");
            chan = 1;
        } else if (starts(s, n, i, "<|constrain|>")) {
            i += strlen("<|constrain|>");
        } else {
            for (size_t k = 0; k < LOOM_ARRAY_LEN(words); k++)
                if (cut_short(s, n, i, words[k])) return -1;
            if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z'))) return 0;
            while (i < n && ((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')))
                i++; /* the content type, "json" */
            if (i == n) return -1;
        }
    }
    if (!chan || !*name_len) return 0;
    *at = i + strlen("<|message|>");
    return 1;
}

static int parse_harmony(const cJSON *tools, const char *s, size_t n, loom_tp_call_t **calls,
                         size_t *end) {
    size_t i = 0;
    int nc = 0;
    for (;;) {
        size_t at = i, name_at = 0, name_len = 0;
        if (loom_tp_harmony_header(s, n, &at, &name_at, &name_len) <= 0) break;
        if (!known(tools, s + name_at, name_len)) goto fail;
        /* the arguments run to <|call|>, or to the end (a stop token the
           decoder may leave out) */
        const char *c = memmem(s + at, n - at, "<|call|>", strlen("<|call|>"));
        size_t ae = c ? (size_t)(c - s) : n;
        char *args = compact_json(s + at, ae - at, 0);
        if (!args) goto fail;
        add_call(calls, &nc, dup_n(s + name_at, name_len), args);
        i = c ? ae + strlen("<|call|>") : n;
    }
    if (!nc) goto fail;
    /* a final message after the calls: its text is content */
    size_t f = skip_ws(s, n, i);
    if (starts(s, n, f, HM_START "<|channel|>final<|message|>"))
        i = f + strlen(HM_START "<|channel|>final<|message|>");
    *end = i;
    return nc;
fail:
    loom_tp_calls_free(*calls, nc);
    *calls = NULL;
    return -1;
}

int loom_tp_parse(loom_toolfmt_t f, const cJSON *tools, const char *text, size_t len,
                  loom_tp_call_t **calls, size_t *end) {
    *calls = NULL;
    *end = 0;
    switch (f) {
    case LOOM_TOOLFMT_DEEPSEEK_V3:
    case LOOM_TOOLFMT_DEEPSEEK_V31:
        if (!starts(text, len, 0, DS_CALLS_BEGIN)) return -1;
        return parse_deepseek(f == LOOM_TOOLFMT_DEEPSEEK_V31, tools, text, len, calls, end);
    case LOOM_TOOLFMT_PYTHONIC:
        return parse_pythonic(tools, text, len, calls, end);
    case LOOM_TOOLFMT_OPENAI:
        return parse_harmony(tools, text, len, calls, end);
    case LOOM_TOOLFMT_QWEN3_CODER:
        return parse_coder(tools, text, len, calls, end);
    case LOOM_TOOLFMT_LLAMA4_PYTHONIC: { /* the list, maybe between <|python_start|> and
                                            <|python_end|> */
        size_t a = skip_ws(text, len, 0), b = len;
        while (b > a && is_space(text[b - 1]))
            b--;
        if (starts(text, len, a, "<|python_start|>")) {
            a += strlen("<|python_start|>");
            if (b - a >= strlen("<|python_end|>") &&
                !memcmp(text + b - strlen("<|python_end|>"), "<|python_end|>",
                        strlen("<|python_end|>")))
                b -= strlen("<|python_end|>");
        }
        size_t e = 0;
        int n = parse_pythonic(tools, text + a, b - a, calls, &e);
        *end = len;
        return n;
    }
    default:
        return -1;
    }
}

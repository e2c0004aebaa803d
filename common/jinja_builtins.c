/* Jinja builtins: the filters, tests, globals and str/dict/list methods that
 * chat templates use, with jinja2's and Python's semantics (transformers'
 * tojson, the sandbox's refusal of methods that mutate). */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/jinja_impl.h"

bool loom_jinja_contains(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t needle, jv_t hay);
jv_t loom_jinja_percent_format(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t fmt,
                               jv_t args);

#define FAIL(...)   loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, __VA_ARGS__)
#define STREQ(a, b) (strcmp((a), (b)) == 0)

/* Argument I (positional) or keyword NAME, or DFLT. */
static jv_t arg(loom_jinja_args_t *a, int i, const char *name, jv_t dflt) {
    if (i >= 0 && i < a->n) return a->v[i];
    for (int k = 0; name && k < a->nkw; k++)
        if (STREQ(a->kwn[k], name)) return a->kwv[k];
    return dflt;
}
static jv_t undef(void) {
    return loom_jinja_undef(NULL);
}
static jv_t none(void) {
    return loom_jinja_none();
}

static loom_jinja_str_t *need_str(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v,
                                  const char *what) {
    if (v.t == JV_STR) return v.u.s;
    if (v.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, v);
    FAIL("%s: expected a string, got %s", what, loom_jinja_type_name(v));
}
static int64_t need_int(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v,
                        const char *what) {
    if (v.t == JV_INT) return v.u.i;
    if (v.t == JV_BOOL) return v.u.b;
    FAIL("%s: expected an integer, got %s", what, loom_jinja_type_name(v));
}

static bool py_space(unsigned char c) {
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static bool cp_space(uint32_t c) {
    return (c < 0x80 && py_space((unsigned char)c)) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* Byte length of the whitespace code point (str.isspace) at P[I], or 0. */
static size_t ws_at(const char *p, size_t n, size_t i) {
    unsigned char c = (unsigned char)p[i];
    if (c < 0x80) return py_space(c) ? 1 : 0;
    size_t l = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 0;
    if (!l || i + l > n) return 0;
    uint32_t cp = l == 2 ? (c & 0x1Fu) : (c & 0x0Fu);
    for (size_t k = 1; k < l; k++) {
        unsigned char d = (unsigned char)p[i + k];
        if ((d & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (d & 0x3Fu);
    }
    return cp_space(cp) ? l : 0;
}

/* Byte length of the line break (str.splitlines) at P[I]: \r\n, \n, \r, \v,
 * \f, \x1c-\x1e, U+0085, U+2028, U+2029; 0 when there is none. */
static size_t line_break_at(const char *p, size_t n, size_t i) {
    unsigned char c = (unsigned char)p[i];
    if (c == '\r') return i + 1 < n && p[i + 1] == '\n' ? 2 : 1;
    if (c == '\n' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e)) return 1;
    if (c == 0xC2 && i + 1 < n && (unsigned char)p[i + 1] == 0x85) return 2;
    if (c == 0xE2 && i + 2 < n && (unsigned char)p[i + 1] == 0x80 &&
        ((unsigned char)p[i + 2] == 0xA8 || (unsigned char)p[i + 2] == 0xA9))
        return 3;
    return 0;
}

/* Byte length of the whitespace code point that ends at P[I] (exclusive), at or after A, or 0. */
static size_t ws_before(const char *p, size_t a, size_t i) {
    if (i <= a) return 0;
    size_t k = i - 1;
    while (k > a && ((unsigned char)p[k] & 0xC0) == 0x80 && i - k < 4)
        k--;
    size_t l = ws_at(p, i, k);
    return l == i - k ? l : 0;
}

static jv_t strip(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v, jv_t chars, bool l,
                  bool r) {
    loom_jinja_str_t *s = need_str(cx, at, v, "strip");
    size_t a = 0, b = s->len;
    if (chars.t == JV_STR) {
        const loom_jinja_str_t *c = chars.u.s;
        if (l)
            while (a < b && memchr(c->p, s->p[a], c->len))
                a++;
        if (r)
            while (b > a && memchr(c->p, s->p[b - 1], c->len))
                b--;
    } else {
        size_t w;
        if (l)
            while (a < b && (w = ws_at(s->p, b, a)))
                a += w;
        if (r)
            while (b > a && (w = ws_before(s->p, a, b)))
                b -= w;
    }
    return loom_jinja_substr(cx, s, a, b);
}

/* Case mapping of ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic
 * letters: each maps to a code point of the same UTF-8 length, so the data
 * spans stay valid. Other letters are left as they are. */
static uint32_t cp_upper(uint32_t c) {
    if (c >= 'a' && c <= 'z') return c - 32;
    if (c < 0x80) return c;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 0x20;
    if (c == 0xFF) return 0x178;
    if (c >= 0x100 && c <= 0x17F && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 &&
        c != 0x17F) {
        bool odd_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
        if (odd_lower ? (c & 1) == 0 : (c & 1) == 1) return c - 1;
        return c;
    }
    if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 0x20;
    if (c >= 0x430 && c <= 0x44F) return c - 0x20;
    if (c >= 0x450 && c <= 0x45F) return c - 0x50;
    return c;
}
static uint32_t cp_lower(uint32_t c) {
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c < 0x80) return c;
    if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
    if (c == 0x178) return 0xFF;
    if (c >= 0x100 && c <= 0x17F && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 &&
        c != 0x17F) {
        bool odd_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
        if (odd_lower ? (c & 1) == 1 : (c & 1) == 0) return c + 1;
        return c;
    }
    if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 0x20;
    if (c >= 0x410 && c <= 0x42F) return c + 0x20;
    if (c >= 0x400 && c <= 0x40F) return c + 0x50;
    return c;
}
static bool cp_isupper(uint32_t c) {
    return cp_lower(c) != c;
}
static bool cp_islower(uint32_t c) {
    return cp_upper(c) != c;
}

/* Decodes the code point at P[*I] (advancing *I); invalid bytes come back as themselves. */
static uint32_t utf8_next(const char *p, size_t n, size_t *i, size_t *len) {
    unsigned char c = (unsigned char)p[*i];
    size_t l = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (*i + l > n) l = 1;
    uint32_t cp = l == 1 ? c : l == 2 ? (c & 0x1Fu) : l == 3 ? (c & 0x0Fu) : (c & 0x07u);
    for (size_t k = 1; k < l; k++) {
        unsigned char d = (unsigned char)p[*i + k];
        if ((d & 0xC0) != 0x80) {
            l = 1;
            cp = c;
            break;
        }
        cp = (cp << 6) | (d & 0x3Fu);
    }
    *len = l;
    *i += l;
    return cp;
}
static void utf8_put_same(char *o, uint32_t cp, size_t len) {
    if (len == 1)
        o[0] = (char)cp;
    else if (len == 2) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
    } else if (len == 3) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
    } else {
        o[0] = (char)(0xF0 | (cp >> 18));
        o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[3] = (char)(0x80 | (cp & 0x3F));
    }
}
/* The code point mapped, if its UTF-8 length stays the same. */
static uint32_t map_cp(uint32_t c, size_t len, bool up) {
    if (len == 1 && c >= 0x80) return c; /* an invalid byte */
    uint32_t m = up ? cp_upper(c) : cp_lower(c);
    size_t ml = m < 0x80 ? 1 : m < 0x800 ? 2 : m < 0x10000 ? 3 : 4;
    return ml == len ? m : c;
}

/* mode: 0 lower, 1 upper, 2 capitalize, 3 swapcase, 4 str.title, 5 the title filter */
static jv_t map_case(loom_jinja_ctx_t *cx, loom_jinja_str_t *s, int mode) {
    char *p = loom_jinja_alloc(cx, s->len + 1);
    bool prev_cased = false, start = true;
    for (size_t i = 0, at = 0; i < s->len;) {
        size_t l;
        uint32_t c = utf8_next(s->p, s->len, &i, &l);
        bool up;
        bool cased = cp_isupper(c) || cp_islower(c);
        switch (mode) {
        case 0:
            up = false;
            break;
        case 1:
            up = true;
            break;
        case 2:
            up = at == 0;
            break;
        case 3:
            up = cp_islower(c);
            break;
        case 4:
            up = !prev_cased;
            break;
        default: {
            bool sep = c == '-' || (c < 0x80 && py_space((unsigned char)c)) || c == '(' ||
                       c == '{' || c == '[' || c == '<';
            up = start;
            start = sep;
            break;
        }
        }
        prev_cased = cased;
        utf8_put_same(p + at, map_cp(c, l, up), l);
        at += l;
    }
    jv_t r = loom_jinja_str(cx, p, s->len, false);
    if (mode <= 3) {
        r.u.s->sp = s->sp;
        r.u.s->nsp = s->nsp;
    }
    return r;
}

static jv_t replace(loom_jinja_ctx_t *cx, loom_jinja_str_t *s, loom_jinja_str_t *old,
                    loom_jinja_str_t *new_, int64_t count) {
    loom_jinja_buf_t b = {0};
    size_t i = 0;
    int64_t done = 0;
    if (!old->len) {
        for (size_t k = 0; k <= s->len; k++) {
            if (count < 0 || done < count) {
                loom_jinja_buf_put(cx, &b, new_->p, new_->len);
                done++;
            }
            if (k < s->len) loom_jinja_buf_putc(cx, &b, s->p[k]);
        }
        return loom_jinja_buf_take(cx, &b);
    }
    while (i < s->len) {
        if ((count < 0 || done < count) && i + old->len <= s->len &&
            memcmp(s->p + i, old->p, old->len) == 0) {
            loom_jinja_buf_put(cx, &b, new_->p, new_->len);
            i += old->len;
            done++;
        } else {
            loom_jinja_buf_putc(cx, &b, s->p[i++]);
        }
    }
    return loom_jinja_buf_take(cx, &b);
}

static int64_t find(const loom_jinja_str_t *s, const loom_jinja_str_t *sub, size_t from, bool rev) {
    if (sub->len > s->len) return -1;
    if (!rev) {
        for (size_t i = from; i + sub->len <= s->len; i++)
            if (memcmp(s->p + i, sub->p, sub->len) == 0) return (int64_t)i;
    } else {
        for (size_t i = s->len - sub->len + 1; i-- > from;)
            if (memcmp(s->p + i, sub->p, sub->len) == 0) return (int64_t)i;
    }
    return -1;
}

static size_t cps(const char *p, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)p[i] & 0xC0) != 0x80;
    return c;
}

static jv_t split(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_str_t *s, jv_t sep,
                  int64_t maxsplit) {
    jv_t r = loom_jinja_list_new(cx, 4);
    if (sep.t == JV_STR) {
        if (!sep.u.s->len) FAIL("empty separator");
        size_t a = 0;
        int64_t n = 0;
        for (;;) {
            int64_t f = (maxsplit < 0 || n < maxsplit) ? find(s, sep.u.s, a, false) : -1;
            if (f < 0) break;
            loom_jinja_list_push(cx, r.u.l, loom_jinja_substr(cx, s, a, (size_t)f));
            a = (size_t)f + sep.u.s->len;
            n++;
            loom_jinja_step(cx, at);
        }
        loom_jinja_list_push(cx, r.u.l, loom_jinja_substr(cx, s, a, s->len));
        return r;
    }
    size_t i = 0;
    int64_t n = 0;
    size_t w;
    while (i < s->len) {
        while (i < s->len && (w = ws_at(s->p, s->len, i)))
            i += w;
        if (i >= s->len) break;
        if (maxsplit >= 0 && n >= maxsplit) { /* the rest as it is, trailing space included */
            loom_jinja_list_push(cx, r.u.l, loom_jinja_substr(cx, s, i, s->len));
            break;
        }
        size_t j = i;
        while (j < s->len && !ws_at(s->p, s->len, j))
            j++;
        loom_jinja_list_push(cx, r.u.l, loom_jinja_substr(cx, s, i, j));
        n++;
        i = j;
        loom_jinja_step(cx, at);
    }
    return r;
}

static jv_t join(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t seq, loom_jinja_str_t *sep,
                 jv_t attribute, bool strict) {
    loom_jinja_list_t *l = loom_jinja_iterate(cx, at, seq);
    loom_jinja_buf_t b = {0};
    for (size_t i = 0; i < l->n; i++) {
        loom_jinja_step(cx, at);
        if (i && sep) loom_jinja_buf_put_str(cx, &b, sep);
        jv_t v = l->v[i];
        if (attribute.t == JV_STR)
            v = loom_jinja_getattr(cx, at, v, attribute.u.s->p, attribute.u.s->len);
        if (strict && v.t != JV_STR)
            FAIL("sequence item %zu: expected str instance, %s found", i, loom_jinja_type_name(v));
        loom_jinja_write_str(cx, &b, v);
    }
    return loom_jinja_buf_take(cx, &b);
}

/* An attribute path "a.b.0" as jinja2's make_attrgetter walks it. */
static jv_t attr_path(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v, jv_t path) {
    if (path.t == JV_INT) return loom_jinja_getitem(cx, at, v, path);
    loom_jinja_str_t *p = need_str(cx, at, path, "attribute");
    size_t a = 0;
    while (a <= p->len) {
        size_t b = a;
        while (b < p->len && p->p[b] != '.')
            b++;
        bool digits = b > a;
        for (size_t k = a; k < b; k++)
            digits = digits && isdigit((unsigned char)p->p[k]);
        if (digits) {
            v = loom_jinja_getitem(cx, at, v, loom_jinja_int(strtoll(p->p + a, NULL, 10)));
        } else {
            jv_t key = loom_jinja_str(cx, p->p + a, b - a, false);
            if (v.t == JV_UNDEF) return v;
            v = loom_jinja_getitem(cx, at, v, key);
        }
        a = b + 1;
    }
    return v;
}

/* ---- sorting ---- */
typedef struct {
    loom_jinja_ctx_t *cx;
    const loom_jinja_node_t *at;
    bool case_sensitive;
} sort_env_t;

static int sort_cmp_env(sort_env_t *e, jv_t a, jv_t b) {
    if (!e->case_sensitive && a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        for (size_t i = 0; i < n; i++) {
            int x = tolower((unsigned char)a.u.s->p[i]), y = tolower((unsigned char)b.u.s->p[i]);
            if (x != y) return x < y ? -1 : 1;
        }
        return a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len;
    }
    return loom_jinja_cmp(e->cx, e->at, a, b);
}

/* A stable merge sort of KEYS (with VALS carried along). */
static void msort(sort_env_t *e, jv_t *keys, jv_t *vals, jv_t *tk, jv_t *tv, size_t n, bool rev) {
    if (n < 2) return;
    size_t m = n / 2;
    msort(e, keys, vals, tk, tv, m, rev);
    msort(e, keys + m, vals + m, tk, tv, n - m, rev);
    size_t i = 0, j = m, k = 0;
    while (i < m && j < n) {
        int c = sort_cmp_env(e, keys[i], keys[j]);
        bool take_right = rev ? c < 0 : c > 0;
        if (take_right) {
            tk[k] = keys[j];
            tv[k++] = vals[j++];
        } else {
            tk[k] = keys[i];
            tv[k++] = vals[i++];
        }
    }
    while (i < m) {
        tk[k] = keys[i];
        tv[k++] = vals[i++];
    }
    while (j < n) {
        tk[k] = keys[j];
        tv[k++] = vals[j++];
    }
    memcpy(keys, tk, n * sizeof *keys);
    memcpy(vals, tv, n * sizeof *vals);
}

static jv_t sorted(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_list_t *l,
                   jv_t *keys, bool rev, bool cs) {
    size_t n = l->n;
    jv_t r = loom_jinja_list_new(cx, n);
    jv_t *k = keys, *tk = loom_jinja_alloc(cx, (n + 1) * sizeof *tk),
         *tv = loom_jinja_alloc(cx, (n + 1) * sizeof *tv);
    if (n) memcpy(r.u.l->v, l->v, n * sizeof *l->v);
    r.u.l->n = n;
    cx->steps += n;
    sort_env_t e = {cx, at, cs};
    msort(&e, k, r.u.l->v, tk, tv, n, rev);
    return r;
}

/* ---- tests ---- */
static const char *const k_tests[] = {
    "defined",     "undefined", "none",   "string",      "mapping",  "iterable", "sequence",
    "number",      "integer",   "float",  "boolean",     "true",     "false",    "in",
    "eq",          "equalto",   "==",     "ne",          "!=",       "lt",       "<",
    "le",          "<=",        "gt",     ">",           "ge",       ">=",       "lessthan",
    "greaterthan", "odd",       "even",   "divisibleby", "callable", "lower",    "upper",
    "sameas",      "escaped",   "filter", "test",        NULL};

bool loom_jinja_has_test(const char *name) {
    for (int i = 0; k_tests[i]; i++)
        if (STREQ(k_tests[i], name)) return true;
    return false;
}

bool loom_jinja_test(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *at,
                     const char *name, jv_t v, loom_jinja_args_t *a) {
    (void)sc;
    jv_t x = arg(a, 0, NULL, undef());
    if (STREQ(name, "defined")) return v.t != JV_UNDEF;
    if (STREQ(name, "undefined")) return v.t == JV_UNDEF;
    if (STREQ(name, "none")) return v.t == JV_NONE;
    if (STREQ(name, "string")) return v.t == JV_STR;
    if (STREQ(name, "mapping")) return v.t == JV_DICT;
    if (STREQ(name, "iterable"))
        return v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    if (STREQ(name, "sequence"))
        return v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    if (STREQ(name, "number")) return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL;
    if (STREQ(name, "integer")) return v.t == JV_INT;
    if (STREQ(name, "float")) return v.t == JV_FLOAT;
    if (STREQ(name, "boolean")) return v.t == JV_BOOL;
    if (STREQ(name, "true")) return v.t == JV_BOOL && v.u.b;
    if (STREQ(name, "false")) return v.t == JV_BOOL && !v.u.b;
    if (STREQ(name, "callable")) return v.t == JV_FUNC;
    if (STREQ(name, "escaped")) return false;
    if (STREQ(name, "in")) return loom_jinja_contains(cx, at, v, x);
    if (STREQ(name, "eq") || STREQ(name, "equalto") || STREQ(name, "=="))
        return loom_jinja_eq(v, x);
    if (STREQ(name, "ne") || STREQ(name, "!=")) return !loom_jinja_eq(v, x);
    if (STREQ(name, "sameas")) {
        if (v.t != x.t) return false;
        if (v.t == JV_NONE || v.t == JV_UNDEF) return true;
        if (v.t == JV_BOOL) return v.u.b == x.u.b;
        if (v.t == JV_INT) return v.u.i == x.u.i && v.u.i >= -5 && v.u.i <= 256;
        if (v.t == JV_LIST) return v.u.l == x.u.l;
        if (v.t == JV_DICT) return v.u.d == x.u.d;
        return false;
    }
    if (STREQ(name, "lt") || STREQ(name, "<") || STREQ(name, "lessthan"))
        return loom_jinja_cmp(cx, at, v, x) < 0;
    if (STREQ(name, "le") || STREQ(name, "<=")) return loom_jinja_cmp(cx, at, v, x) <= 0;
    if (STREQ(name, "gt") || STREQ(name, ">") || STREQ(name, "greaterthan"))
        return loom_jinja_cmp(cx, at, v, x) > 0;
    if (STREQ(name, "ge") || STREQ(name, ">=")) return loom_jinja_cmp(cx, at, v, x) >= 0;
    if (STREQ(name, "odd") || STREQ(name, "even")) {
        if (v.t == JV_FLOAT) {
            double m = fmod(v.u.f, 2.0);
            return STREQ(name, "odd") ? fabs(m) == 1.0 : m == 0.0;
        }
        int64_t i = need_int(cx, at, v, name);
        return STREQ(name, "odd") ? (i % 2 != 0) : (i % 2 == 0);
    }
    if (STREQ(name, "divisibleby")) {
        if (v.t == JV_FLOAT || x.t == JV_FLOAT) {
            double fv = v.t == JV_FLOAT ? v.u.f : (double)need_int(cx, at, v, "divisibleby");
            double fx = x.t == JV_FLOAT ? x.u.f : (double)need_int(cx, at, x, "divisibleby");
            if (fx == 0) FAIL("float modulo");
            return fmod(fv, fx) == 0;
        }
        int64_t d = need_int(cx, at, x, "divisibleby"), i = need_int(cx, at, v, "divisibleby");
        if (d == 0) FAIL("integer division or modulo by zero");
        return d == -1 || i % d == 0;
    }
    if (STREQ(name, "lower") || STREQ(name, "upper")) {
        v = loom_jinja_to_str(cx, v); /* jinja2: str(value).islower() */
        bool cased = false;
        for (size_t i = 0; i < v.u.s->len; i++) {
            unsigned char c = (unsigned char)v.u.s->p[i];
            if (isalpha(c)) {
                cased = true;
                if (name[0] == 'l' ? isupper(c) : islower(c)) return false;
            }
        }
        return cased;
    }
    if (STREQ(name, "filter")) return x.t == JV_STR && loom_jinja_has_filter(x.u.s->p);
    if (STREQ(name, "test")) return x.t == JV_STR && loom_jinja_has_test(x.u.s->p);
    FAIL("no test named '%s'", name);
}

/* select/reject/selectattr/rejectattr: ARGS from FIRST on name the test and its arguments. */
static jv_t select_items(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *at,
                         jv_t seq, loom_jinja_args_t *a, bool attr, bool want) {
    if (!loom_jinja_truthy(seq))
        return loom_jinja_list_new(cx, 0); /* jinja2: `if value: for item in value` */
    loom_jinja_list_t *l = loom_jinja_iterate(cx, at, seq);
    jv_t r = loom_jinja_list_new(cx, l->n);
    int first = 0;
    jv_t path = undef();
    if (attr) {
        if (a->n < 1) FAIL("selectattr needs an attribute");
        path = a->v[0];
        first = 1;
    }
    const char *test = NULL;
    if (a->n > first) test = need_str(cx, at, a->v[first], "test name")->p;
    if (test && !loom_jinja_has_test(test)) FAIL("no test named '%s'", test);
    loom_jinja_args_t ta = {a->v + first + 1, a->n > first + 1 ? a->n - first - 1 : 0, a->kwn,
                            a->kwv, a->nkw};
    for (size_t i = 0; i < l->n; i++) {
        loom_jinja_step(cx, at);
        jv_t v = attr ? attr_path(cx, at, l->v[i], path) : l->v[i];
        bool ok = test ? loom_jinja_test(cx, sc, at, test, v, &ta) : loom_jinja_truthy(v);
        if (ok == want) r.u.l->v[r.u.l->n++] = l->v[i];
    }
    return r;
}

static jv_t to_int(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v, jv_t dflt, int base) {
    if (v.t == JV_INT) return v;
    if (v.t == JV_BOOL) return loom_jinja_int(v.u.b);
    if (v.t == JV_FLOAT) {
        if (!isfinite(v.u.f)) return dflt;
        return loom_jinja_int((int64_t)v.u.f);
    }
    if (v.t == JV_STR) {
        char buf[64];
        size_t n = v.u.s->len;
        const char *p = v.u.s->p;
        while (n && py_space((unsigned char)*p))
            p++, n--;
        while (n && py_space((unsigned char)p[n - 1]))
            n--;
        if (!n || n >= sizeof buf) return dflt;
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            if (p[i] != '_') buf[k++] = p[i];
        buf[k] = '\0';
        char *end;
        long long r = strtoll(buf, &end, base);
        if (*end == '\0' && end != buf) return loom_jinja_int(r);
        double f = strtod(buf, &end);
        if (*end == '\0' && end != buf && isfinite(f)) return loom_jinja_int((int64_t)f);
    }
    (void)cx, (void)at;
    return dflt;
}

static jv_t to_float(jv_t v, jv_t dflt) {
    if (v.t == JV_FLOAT) return v;
    if (v.t == JV_INT) return loom_jinja_float((double)v.u.i);
    if (v.t == JV_BOOL) return loom_jinja_float(v.u.b);
    if (v.t == JV_STR && v.u.s->len < 64) {
        char buf[64];
        memcpy(buf, v.u.s->p, v.u.s->len);
        buf[v.u.s->len] = '\0';
        char *end;
        double f = strtod(buf, &end);
        while (*end && py_space((unsigned char)*end))
            end++;
        if (end != buf && *end == '\0') return loom_jinja_float(f);
    }
    return dflt;
}

static jv_t do_round(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v, int64_t prec,
                     const char *method) {
    double f;
    if (v.t == JV_INT || v.t == JV_BOOL)
        f = (double)(v.t == JV_INT ? v.u.i : v.u.b);
    else if (v.t == JV_FLOAT)
        f = v.u.f;
    else
        FAIL("round: expected a number, got %s", loom_jinja_type_name(v));
    double m = pow(10.0, (double)prec);
    double r;
    if (STREQ(method, "common") && v.t != JV_FLOAT && prec >= 0)
        return loom_jinja_int(v.t == JV_INT ? v.u.i : v.u.b);
    if (STREQ(method, "common")) {
        /* Python's round() is round-half-even on the exact binary value */
        double x = f * m;
        r = nearbyint(x);
        if (fabs(x - trunc(x)) == 0.5) r = 2.0 * nearbyint(x / 2.0);
        char buf[64];
        snprintf(buf, sizeof buf, "%.*f", (int)(prec < 0 ? 0 : prec > 30 ? 30 : prec), f);
        if (prec >= 0) r = strtod(buf, NULL) * m;
        return loom_jinja_float(prec >= 0 ? strtod(buf, NULL) : r / m);
    }
    if (STREQ(method, "ceil"))
        r = ceil(f * m) / m;
    else if (STREQ(method, "floor"))
        r = floor(f * m) / m;
    else
        FAIL("method must be common, ceil or floor");
    return loom_jinja_float(r);
}

static jv_t indent(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v, jv_t width,
                   bool first, bool blank) {
    if (v.t != JV_STR)
        FAIL("indent: can only concatenate str (not \"%s\") to str", loom_jinja_type_name(v));
    loom_jinja_str_t *s = v.u.s;
    loom_jinja_buf_t ind = {0};
    if (width.t == JV_STR)
        loom_jinja_buf_put_str(cx, &ind, width.u.s);
    else
        for (int64_t i = 0, w = need_int(cx, at, width, "indent"); i < w; i++)
            loom_jinja_buf_putc(cx, &ind, ' ');
    /* jinja2: lines = (s + "\n").splitlines(); the first is not indented
     * (unless FIRST), blank ones only with BLANK */
    loom_jinja_buf_t b = {0};
    if (first) loom_jinja_buf_put(cx, &b, ind.p, ind.len);
    const char *p = s->p;
    size_t n = s->len, i = 0, line = 0;
    for (;;) {
        size_t j = i, lb = 0;
        while (j < n && !(lb = line_break_at(p, n, j)))
            j++;
        if (line > 0) {
            loom_jinja_buf_putc(cx, &b, '\n');
            if (blank || j > i) loom_jinja_buf_put(cx, &b, ind.p, ind.len);
        }
        loom_jinja_buf_put(cx, &b, p + i, j - i);
        line++;
        if (j >= n) break; /* the line the appended "\n" ends */
        i = j + lb;
    }
    return loom_jinja_buf_take(cx, &b);
}

static jv_t html_escape(loom_jinja_ctx_t *cx, jv_t v) {
    loom_jinja_str_t *s = loom_jinja_to_str(cx, v).u.s;
    loom_jinja_buf_t b = {0};
    for (size_t i = 0; i < s->len; i++) {
        switch (s->p[i]) {
        case '&':
            loom_jinja_buf_put(cx, &b, "&amp;", 5);
            break;
        case '<':
            loom_jinja_buf_put(cx, &b, "&lt;", 4);
            break;
        case '>':
            loom_jinja_buf_put(cx, &b, "&gt;", 4);
            break;
        case '"':
            loom_jinja_buf_put(cx, &b, "&#34;", 5);
            break;
        case '\'':
            loom_jinja_buf_put(cx, &b, "&#39;", 5);
            break;
        default:
            loom_jinja_buf_putc(cx, &b, s->p[i]);
        }
    }
    return loom_jinja_buf_take(cx, &b);
}

static jv_t tojson(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v,
                   loom_jinja_args_t *a) {
    jv_t ind = arg(a, 1, "indent", none()), seps = arg(a, 2, "separators", none()),
         sk = arg(a, 3, "sort_keys", none());
    jv_t ea = arg(a, 0, "ensure_ascii", none());
    if (loom_jinja_truthy(ea)) FAIL("tojson: ensure_ascii=True is not supported");
    int indent = -1;
    if (ind.t == JV_INT)
        indent = (int)(ind.u.i < 0 ? 0 : ind.u.i > 32 ? 32 : ind.u.i);
    else if (ind.t != JV_NONE && ind.t != JV_UNDEF)
        FAIL("tojson: indent must be an integer");
    const char *item_sep = indent >= 0 ? "," : ", ", *key_sep = ": ";
    if (seps.t == JV_LIST && seps.u.l->n == 2 && seps.u.l->v[0].t == JV_STR &&
        seps.u.l->v[1].t == JV_STR) {
        char *x = loom_jinja_alloc(cx, seps.u.l->v[0].u.s->len + 1),
             *y = loom_jinja_alloc(cx, seps.u.l->v[1].u.s->len + 1);
        memcpy(x, seps.u.l->v[0].u.s->p, seps.u.l->v[0].u.s->len);
        x[seps.u.l->v[0].u.s->len] = '\0';
        memcpy(y, seps.u.l->v[1].u.s->p, seps.u.l->v[1].u.s->len);
        y[seps.u.l->v[1].u.s->len] = '\0';
        item_sep = x;
        key_sep = y;
    } else if (seps.t != JV_NONE && seps.t != JV_UNDEF) {
        FAIL("tojson: separators must be a pair of strings");
    }
    loom_jinja_buf_t b = {0};
    loom_jinja_write_json(cx, at, &b, v, indent, item_sep, key_sep, loom_jinja_truthy(sk), 0);
    return loom_jinja_buf_take(cx, &b);
}

static jv_t items_of(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v) {
    if (v.t == JV_UNDEF) return loom_jinja_list_new(cx, 0);
    if (v.t != JV_DICT) FAIL("can only get item pairs from a mapping");
    jv_t r = loom_jinja_list_new(cx, v.u.d->n);
    for (size_t i = 0; i < v.u.d->n; i++) {
        jv_t t = loom_jinja_list_new(cx, 2);
        t.u.l->tuple = true;
        t.u.l->v[0] = v.u.d->k[i];
        t.u.l->v[1] = v.u.d->v[i];
        t.u.l->n = 2;
        r.u.l->v[r.u.l->n++] = t;
    }
    return r;
}

static const char *const k_filters[] = {
    "trim",   "upper",      "lower",      "title", "capitalize", "replace",     "length",
    "count",  "first",      "last",       "join",  "default",    "d",           "list",
    "items",  "selectattr", "rejectattr", "map",   "select",     "reject",      "reverse",
    "sort",   "unique",     "string",     "int",   "float",      "round",       "abs",
    "indent", "dictsort",   "safe",       "e",     "escape",     "forceescape", "tojson",
    "batch",  "wordcount",  "format",     "min",   "max",        "sum",         "attr",
    "center", "truncate",   "striptags",  NULL};

bool loom_jinja_has_filter(const char *name) {
    for (int i = 0; k_filters[i]; i++)
        if (STREQ(k_filters[i], name)) return true;
    return false;
}

static jv_t length_of(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v) {
    switch (v.t) {
    case JV_STR:
        return loom_jinja_int((int64_t)cps(v.u.s->p, v.u.s->len));
    case JV_LIST:
        return loom_jinja_int((int64_t)v.u.l->n);
    case JV_DICT:
    case JV_NS:
        return loom_jinja_int((int64_t)v.u.d->n);
    case JV_UNDEF:
        return loom_jinja_int(0);
    default:
        FAIL("object of type '%s' has no len()", loom_jinja_type_name(v));
    }
}

jv_t loom_jinja_filter(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *at,
                       const char *name, jv_t v, loom_jinja_args_t *a) {
    if (STREQ(name, "trim"))
        return strip(cx, at, v.t == JV_STR ? v : loom_jinja_to_str(cx, v),
                     arg(a, 0, "chars", none()), true, true);
    if (STREQ(name, "upper")) return map_case(cx, loom_jinja_to_str(cx, v).u.s, 1);
    if (STREQ(name, "lower")) return map_case(cx, loom_jinja_to_str(cx, v).u.s, 0);
    if (STREQ(name, "capitalize")) return map_case(cx, loom_jinja_to_str(cx, v).u.s, 2);
    if (STREQ(name, "title")) return map_case(cx, loom_jinja_to_str(cx, v).u.s, 5);
    if (STREQ(name, "replace")) {
        jv_t c = arg(a, 2, "count", none());
        return replace(
            cx, loom_jinja_to_str(cx, v).u.s, loom_jinja_to_str(cx, arg(a, 0, "old", undef())).u.s,
            loom_jinja_to_str(cx, arg(a, 1, "new", undef())).u.s, c.t == JV_INT ? c.u.i : -1);
    }
    if (STREQ(name, "length") || STREQ(name, "count")) return length_of(cx, at, v);
    if (STREQ(name, "first") || STREQ(name, "last")) {
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        if (!l->n) return loom_jinja_undef(NULL);
        return name[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (STREQ(name, "join")) {
        jv_t sep = arg(a, 0, "d", undef());
        return join(cx, at, v, sep.t == JV_UNDEF ? NULL : loom_jinja_to_str(cx, sep).u.s,
                    arg(a, 1, "attribute", none()), false);
    }
    if (STREQ(name, "default") || STREQ(name, "d")) {
        jv_t dv = arg(a, 0, "default_value", loom_jinja_str(cx, "", 0, false));
        bool boolean = loom_jinja_truthy(arg(a, 1, "boolean", loom_jinja_bool(false)));
        if (v.t == JV_UNDEF || (boolean && !loom_jinja_truthy(v))) return dv;
        return v;
    }
    if (STREQ(name, "list")) {
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t r = loom_jinja_list_new(cx, l->n);
        if (l->n) memcpy(r.u.l->v, l->v, l->n * sizeof *l->v);
        r.u.l->n = l->n;
        return r;
    }
    if (STREQ(name, "items")) return items_of(cx, at, v);
    if (STREQ(name, "selectattr")) return select_items(cx, sc, at, v, a, true, true);
    if (STREQ(name, "rejectattr")) return select_items(cx, sc, at, v, a, true, false);
    if (STREQ(name, "select")) return select_items(cx, sc, at, v, a, false, true);
    if (STREQ(name, "reject")) return select_items(cx, sc, at, v, a, false, false);
    if (STREQ(name, "map")) {
        if (!loom_jinja_truthy(v)) return loom_jinja_list_new(cx, 0);
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t r = loom_jinja_list_new(cx, l->n);
        jv_t attribute = arg(a, -1, "attribute", undef());
        if (attribute.t != JV_UNDEF) {
            jv_t dflt = arg(a, -1, "default", undef());
            for (size_t i = 0; i < l->n; i++) {
                loom_jinja_step(cx, at);
                jv_t x = attr_path(cx, at, l->v[i], attribute);
                r.u.l->v[r.u.l->n++] = x.t == JV_UNDEF && dflt.t != JV_UNDEF ? dflt : x;
            }
            return r;
        }
        if (a->n < 1) FAIL("map needs a filter name or attribute=");
        const char *f = need_str(cx, at, a->v[0], "filter name")->p;
        if (!loom_jinja_has_filter(f)) FAIL("no filter named '%s'", f);
        loom_jinja_args_t fa = {a->v + 1, a->n - 1, a->kwn, a->kwv, a->nkw};
        for (size_t i = 0; i < l->n; i++) {
            loom_jinja_step(cx, at);
            r.u.l->v[r.u.l->n++] = loom_jinja_filter(cx, sc, at, f, l->v[i], &fa);
        }
        return r;
    }
    if (STREQ(name, "reverse")) {
        if (v.t == JV_STR) {
            loom_jinja_buf_t b = {0};
            for (size_t i = v.u.s->len; i > 0;) {
                size_t j = i - 1;
                while (j > 0 && ((unsigned char)v.u.s->p[j] & 0xC0) == 0x80)
                    j--;
                loom_jinja_buf_put(cx, &b, v.u.s->p + j, i - j);
                i = j;
            }
            return loom_jinja_buf_take(cx, &b);
        }
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t r = loom_jinja_list_new(cx, l->n);
        for (size_t i = l->n; i > 0; i--)
            r.u.l->v[r.u.l->n++] = l->v[i - 1];
        return r;
    }
    if (STREQ(name, "sort")) {
        bool rev = loom_jinja_truthy(arg(a, 0, "reverse", loom_jinja_bool(false)));
        bool cs = loom_jinja_truthy(arg(a, 1, "case_sensitive", loom_jinja_bool(false)));
        jv_t attribute = arg(a, 2, "attribute", none());
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t *keys = loom_jinja_alloc(cx, (l->n + 1) * sizeof *keys);
        for (size_t i = 0; i < l->n; i++)
            keys[i] = attribute.t == JV_NONE ? l->v[i] : attr_path(cx, at, l->v[i], attribute);
        return sorted(cx, at, l, keys, rev, cs);
    }
    if (STREQ(name, "dictsort")) {
        bool cs = loom_jinja_truthy(arg(a, 0, "case_sensitive", loom_jinja_bool(false)));
        jv_t by = arg(a, 1, "by", loom_jinja_str_c(cx, "key"));
        bool rev = loom_jinja_truthy(arg(a, 2, "reverse", loom_jinja_bool(false)));
        if (v.t != JV_DICT) FAIL("dictsort: expected a mapping");
        jv_t it = items_of(cx, at, v);
        int pos = by.t == JV_STR && by.u.s->len == 5 && memcmp(by.u.s->p, "value", 5) == 0 ? 1 : 0;
        jv_t *keys = loom_jinja_alloc(cx, (it.u.l->n + 1) * sizeof *keys);
        for (size_t i = 0; i < it.u.l->n; i++)
            keys[i] = it.u.l->v[i].u.l->v[pos];
        return sorted(cx, at, it.u.l, keys, rev, cs);
    }
    if (STREQ(name, "unique")) {
        bool cs = loom_jinja_truthy(arg(a, 0, "case_sensitive", loom_jinja_bool(false)));
        jv_t attribute = arg(a, 1, "attribute", none());
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t r = loom_jinja_list_new(cx, l->n);
        jv_t *seen = loom_jinja_alloc(cx, (l->n + 1) * sizeof *seen);
        size_t ns = 0;
        for (size_t i = 0; i < l->n; i++) {
            jv_t k = attribute.t == JV_NONE ? l->v[i] : attr_path(cx, at, l->v[i], attribute);
            if (!cs && k.t == JV_STR) k = map_case(cx, k.u.s, 0);
            if ((k.t == JV_LIST && !k.u.l->tuple) || k.t == JV_DICT)
                FAIL("unhashable type: '%s'", loom_jinja_type_name(k));
            bool dup = false;
            for (size_t j = 0; j < ns && !dup; j++) {
                loom_jinja_step(cx, at);
                dup = loom_jinja_eq(seen[j], k);
            }
            if (!dup) {
                seen[ns++] = k;
                r.u.l->v[r.u.l->n++] = l->v[i];
            }
        }
        return r;
    }
    if (STREQ(name, "string")) return loom_jinja_to_str(cx, v);
    if ((STREQ(name, "int") || STREQ(name, "float")) && v.t == JV_UNDEF)
        loom_jinja_undefined_error(cx, at, v);
    if (STREQ(name, "int")) {
        jv_t base = arg(a, 1, "base", loom_jinja_int(10));
        return to_int(cx, at, v, arg(a, 0, "default", loom_jinja_int(0)),
                      (int)need_int(cx, at, base, "int"));
    }
    if (STREQ(name, "float")) return to_float(v, arg(a, 0, "default", loom_jinja_float(0.0)));
    if (STREQ(name, "round")) {
        jv_t m = arg(a, 1, "method", loom_jinja_str_c(cx, "common"));
        return do_round(cx, at, v,
                        need_int(cx, at, arg(a, 0, "precision", loom_jinja_int(0)), "round"),
                        need_str(cx, at, m, "round")->p);
    }
    if (STREQ(name, "abs")) {
        if (v.t == JV_INT) {
            if (v.u.i == INT64_MIN) FAIL("integer overflow");
            return loom_jinja_int(v.u.i < 0 ? -v.u.i : v.u.i);
        }
        if (v.t == JV_BOOL) return loom_jinja_int(v.u.b);
        if (v.t == JV_FLOAT) return loom_jinja_float(fabs(v.u.f));
        FAIL("bad operand type for abs(): '%s'", loom_jinja_type_name(v));
    }
    if (STREQ(name, "indent"))
        return indent(cx, at, v, arg(a, 0, "width", loom_jinja_int(4)),
                      loom_jinja_truthy(arg(a, 1, "first", loom_jinja_bool(false))),
                      loom_jinja_truthy(arg(a, 2, "blank", loom_jinja_bool(false))));
    if (STREQ(name, "safe")) return v.t == JV_STR ? v : loom_jinja_to_str(cx, v);
    if (STREQ(name, "e") || STREQ(name, "escape") || STREQ(name, "forceescape"))
        return html_escape(cx, v);
    if (STREQ(name, "tojson")) return tojson(cx, at, v, a);
    if (STREQ(name, "format")) {
        jv_t t = loom_jinja_list_new(cx, (size_t)a->n);
        t.u.l->tuple = true;
        for (int i = 0; i < a->n; i++)
            t.u.l->v[t.u.l->n++] = a->v[i];
        return loom_jinja_percent_format(cx, at, loom_jinja_to_str(cx, v), t);
    }
    if (STREQ(name, "wordcount")) {
        loom_jinja_str_t *s = loom_jinja_to_str(cx, v).u.s;
        int64_t n = 0;
        bool in = false;
        for (size_t i = 0; i < s->len;) {
            unsigned char c = (unsigned char)s->p[i];
            size_t ws = c >= 0x80 ? ws_at(s->p, s->len, i) : 0;
            bool w = isalnum(c) || c == '_' || (c >= 0x80 && !ws);
            if (w && !in) n++;
            in = w;
            i += ws ? ws : 1;
        }
        return loom_jinja_int(n);
    }
    if (STREQ(name, "batch")) {
        int64_t k = need_int(cx, at, arg(a, 0, "linecount", undef()), "batch");
        if (k <= 0) FAIL("batch: linecount must be positive");
        jv_t fill = arg(a, 1, "fill_with", none());
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t r = loom_jinja_list_new(cx, 0), cur = loom_jinja_list_new(cx, 0);
        for (size_t i = 0; i < l->n; i++) {
            loom_jinja_list_push(cx, cur.u.l, l->v[i]);
            if ((int64_t)cur.u.l->n == k) {
                loom_jinja_list_push(cx, r.u.l, cur);
                cur = loom_jinja_list_new(cx, 0);
            }
        }
        if (cur.u.l->n) {
            if (fill.t != JV_NONE)
                while ((int64_t)cur.u.l->n < k)
                    loom_jinja_list_push(cx, cur.u.l, fill);
            loom_jinja_list_push(cx, r.u.l, cur);
        }
        return r;
    }
    if (STREQ(name, "min") || STREQ(name, "max")) {
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        if (!l->n) return undef();
        bool cs = loom_jinja_truthy(arg(a, 0, "case_sensitive", loom_jinja_bool(false)));
        jv_t attribute = arg(a, 1, "attribute", none());
        sort_env_t e = {cx, at, cs};
        size_t best = 0;
        for (size_t i = 1; i < l->n; i++) {
            jv_t x = attribute.t == JV_NONE ? l->v[i] : attr_path(cx, at, l->v[i], attribute);
            jv_t y = attribute.t == JV_NONE ? l->v[best] : attr_path(cx, at, l->v[best], attribute);
            int c = sort_cmp_env(&e, x, y);
            if (name[1] == 'i' ? c < 0 : c > 0) best = i;
        }
        return l->v[best];
    }
    if (STREQ(name, "sum")) {
        loom_jinja_list_t *l = loom_jinja_iterate(cx, at, v);
        jv_t attribute = arg(a, 0, "attribute", none());
        jv_t acc = arg(a, 1, "start", loom_jinja_int(0));
        for (size_t i = 0; i < l->n; i++) {
            jv_t x = attribute.t == JV_NONE ? l->v[i] : attr_path(cx, at, l->v[i], attribute);
            if (!((x.t == JV_INT || x.t == JV_FLOAT || x.t == JV_BOOL) &&
                  (acc.t == JV_INT || acc.t == JV_FLOAT || acc.t == JV_BOOL)))
                FAIL("unsupported operand type(s) for +: '%s' and '%s'", loom_jinja_type_name(acc),
                     loom_jinja_type_name(x));
            if (acc.t == JV_FLOAT || x.t == JV_FLOAT)
                acc = loom_jinja_float(
                    (acc.t == JV_FLOAT ? acc.u.f : (double)(acc.t == JV_INT ? acc.u.i : acc.u.b)) +
                    (x.t == JV_FLOAT ? x.u.f : (double)(x.t == JV_INT ? x.u.i : x.u.b)));
            else
                acc = loom_jinja_int((acc.t == JV_INT ? acc.u.i : acc.u.b) +
                                     (x.t == JV_INT ? x.u.i : x.u.b));
        }
        return acc;
    }
    if (STREQ(name, "attr")) {
        loom_jinja_str_t *n = need_str(cx, at, arg(a, 0, "name", undef()), "attr");
        if (v.t == JV_DICT) return loom_jinja_method(cx, at, v, n->p, n->len);
        return loom_jinja_getattr(cx, at, v, n->p, n->len);
    }
    if (STREQ(name, "center")) {
        loom_jinja_str_t *s = loom_jinja_to_str(cx, v).u.s;
        int64_t w = need_int(cx, at, arg(a, 0, "width", loom_jinja_int(80)), "center");
        int64_t len = (int64_t)cps(s->p, s->len);
        if (w <= len) return loom_jinja_str(cx, s->p, s->len, false);
        if (w > (int64_t)cx->max_output) FAIL("center: width too large");
        int64_t pad = w - len, left = pad / 2 + (pad & w & 1);
        loom_jinja_buf_t b = {0};
        for (int64_t i = 0; i < left; i++)
            loom_jinja_buf_putc(cx, &b, ' ');
        loom_jinja_buf_put_str(cx, &b, s);
        for (int64_t i = 0; i < pad - left; i++)
            loom_jinja_buf_putc(cx, &b, ' ');
        return loom_jinja_buf_take(cx, &b);
    }
    FAIL("the filter '%s' is not supported", name);
}

/* ---- %-formatting and str.format ---- */
static void fmt_one(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_buf_t *b,
                    char conv, const char *flags, int width, int prec, jv_t v) {
    char spec[64], tmp[512];
    loom_jinja_buf_t t = {0};
    switch (conv) {
    case 's':
        loom_jinja_write_str(cx, &t, v);
        break;
    case 'r':
    case 'a':
        loom_jinja_write_repr(cx, &t, v);
        break;
    case 'd':
    case 'i':
    case 'u': {
        int64_t i;
        if (v.t == JV_INT || v.t == JV_BOOL)
            i = v.t == JV_INT ? v.u.i : v.u.b;
        else if (v.t == JV_FLOAT)
            i = (int64_t)v.u.f;
        else
            FAIL("%%d format: a real number is required, not %s", loom_jinja_type_name(v));
        snprintf(spec, sizeof spec, "%%%s%s%slld", flags, width >= 0 ? "*" : "", "");
        if (width >= 0)
            snprintf(tmp, sizeof tmp, spec, width, (long long)i);
        else
            snprintf(tmp, sizeof tmp, spec, (long long)i);
        loom_jinja_buf_put(cx, b, tmp, strlen(tmp));
        return;
    }
    case 'x':
    case 'X':
    case 'o': {
        if (v.t != JV_INT && v.t != JV_BOOL) FAIL("%%%c format: an integer is required", conv);
        long long i = v.t == JV_INT ? v.u.i : v.u.b;
        snprintf(spec, sizeof spec, "%%%s*ll%c", flags, conv);
        snprintf(tmp, sizeof tmp, spec, width < 0 ? 0 : width, i);
        loom_jinja_buf_put(cx, b, tmp, strlen(tmp));
        return;
    }
    case 'f':
    case 'F':
    case 'e':
    case 'E':
    case 'g':
    case 'G': {
        double f;
        if (v.t == JV_FLOAT)
            f = v.u.f;
        else if (v.t == JV_INT || v.t == JV_BOOL)
            f = (double)(v.t == JV_INT ? v.u.i : v.u.b);
        else
            FAIL("must be real number, not %s", loom_jinja_type_name(v));
        snprintf(spec, sizeof spec, "%%%s*.*%c", flags, conv);
        snprintf(tmp, sizeof tmp, spec, width < 0 ? 0 : width, prec < 0 ? 6 : prec, f);
        loom_jinja_buf_put(cx, b, tmp, strlen(tmp));
        return;
    }
    default:
        FAIL("unsupported format character '%c'", conv);
    }
    /* strings: precision truncates, width pads */
    size_t len = t.len;
    if (prec >= 0 && (size_t)prec < len) len = (size_t)prec;
    size_t w = width > 0 ? (size_t)width : 0;
    bool left = strchr(flags, '-') != NULL;
    size_t n = cps(t.p, len);
    if (!left)
        for (size_t i = n; i < w; i++)
            loom_jinja_buf_putc(cx, b, ' ');
    loom_jinja_buf_put(cx, b, t.p, len);
    if (left)
        for (size_t i = n; i < w; i++)
            loom_jinja_buf_putc(cx, b, ' ');
}

jv_t loom_jinja_percent_format(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t fmt,
                               jv_t args) {
    loom_jinja_str_t *f = fmt.u.s;
    jv_t *av = &args;
    size_t an = 1, ai = 0;
    if (args.t == JV_LIST && args.u.l->tuple) {
        av = args.u.l->v;
        an = args.u.l->n;
    }
    loom_jinja_buf_t b = {0};
    for (size_t i = 0; i < f->len; i++) {
        if (f->p[i] != '%') {
            loom_jinja_buf_putc(cx, &b, f->p[i]);
            continue;
        }
        i++;
        if (i >= f->len) FAIL("incomplete format");
        if (f->p[i] == '%') {
            loom_jinja_buf_putc(cx, &b, '%');
            continue;
        }
        jv_t mapkey = undef();
        if (f->p[i] == '(') {
            size_t e = i + 1;
            while (e < f->len && f->p[e] != ')')
                e++;
            if (e >= f->len || args.t != JV_DICT) FAIL("format requires a mapping");
            jv_t *m = loom_jinja_dict_get_s(args.u.d, f->p + i + 1, e - i - 1);
            if (!m) FAIL("format: key not found");
            mapkey = *m;
            i = e + 1;
        }
        char flags[8];
        int nf = 0;
        while (i < f->len && strchr("-+ 0#", f->p[i]) && nf < 6)
            flags[nf++] = f->p[i++];
        flags[nf] = '\0';
        int width = -1, prec = -1;
        if (i < f->len && f->p[i] == '*') {
            if (ai >= an) FAIL("not enough arguments for format string");
            width = (int)need_int(cx, at, av[ai++], "width");
            i++;
        }
        while (i < f->len && isdigit((unsigned char)f->p[i]))
            width = (width < 0 ? 0 : width > 99999 ? 99999 : width) * 10 + (f->p[i++] - '0');
        if (i < f->len && f->p[i] == '.') {
            i++;
            prec = 0;
            while (i < f->len && isdigit((unsigned char)f->p[i]))
                prec = (prec > 99999 ? 99999 : prec) * 10 + (f->p[i++] - '0');
        }
        while (i < f->len && strchr("hlL", f->p[i]))
            i++;
        if (i >= f->len) FAIL("incomplete format");
        if (width > 4096 || prec > 4096) FAIL("format width too large");
        jv_t v;
        if (mapkey.t != JV_UNDEF)
            v = mapkey;
        else {
            if (ai >= an) FAIL("not enough arguments for format string");
            v = av[ai++];
        }
        fmt_one(cx, at, &b, f->p[i], flags, width, prec, v);
    }
    /* Python skips this check for a mapping or a list (anything subscriptable that is not a tuple)
     */
    if (ai < an && args.t != JV_DICT && args.t != JV_UNDEF &&
        !(args.t == JV_LIST && !args.u.l->tuple))
        FAIL("not all arguments converted during string formatting");
    return loom_jinja_buf_take(cx, &b);
}

static jv_t str_format(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_str_t *f,
                       loom_jinja_args_t *a) {
    loom_jinja_buf_t b = {0};
    int auto_i = 0;
    for (size_t i = 0; i < f->len; i++) {
        char c = f->p[i];
        if (c == '}') {
            if (i + 1 < f->len && f->p[i + 1] == '}') {
                loom_jinja_buf_putc(cx, &b, '}');
                i++;
                continue;
            }
            FAIL("Single '}' encountered in format string");
        }
        if (c != '{') {
            loom_jinja_buf_putc(cx, &b, c);
            continue;
        }
        if (i + 1 < f->len && f->p[i + 1] == '{') {
            loom_jinja_buf_putc(cx, &b, '{');
            i++;
            continue;
        }
        size_t e = i + 1;
        while (e < f->len && f->p[e] != '}')
            e++;
        if (e >= f->len) FAIL("Single '{' encountered in format string");
        const char *field = f->p + i + 1;
        size_t fl = e - i - 1;
        const char *colon = memchr(field, ':', fl);
        size_t nl = colon ? (size_t)(colon - field) : fl;
        jv_t v;
        if (nl == 0) {
            v = arg(a, auto_i++, NULL, undef());
            if (v.t == JV_UNDEF)
                FAIL("Replacement index %d out of range for positional args tuple", auto_i - 1);
        } else if (isdigit((unsigned char)field[0])) {
            int idx = atoi(field);
            v = arg(a, idx, NULL, undef());
            if (v.t == JV_UNDEF)
                FAIL("Replacement index %d out of range for positional args tuple", idx);
        } else {
            v = undef();
            for (int k = 0; k < a->nkw; k++)
                if (strlen(a->kwn[k]) == nl && memcmp(a->kwn[k], field, nl) == 0) v = a->kwv[k];
            if (v.t == JV_UNDEF) FAIL("format: missing key '%.*s'", (int)nl, field);
        }
        if (colon && fl - nl > 1) {
            /* [[fill]align][width] for strings; [.prec]f for floats */
            const char *sp = colon + 1;
            size_t sl = fl - nl - 1;
            char fill = ' ', align = 0;
            size_t k = 0;
            if (sl >= 2 && strchr("<>^", sp[1])) {
                fill = sp[0];
                align = sp[1];
                k = 2;
            } else if (sl >= 1 && strchr("<>^", sp[0])) {
                align = sp[0];
                k = 1;
            }
            int width = 0, prec = -1;
            while (k < sl && isdigit((unsigned char)sp[k]))
                width = (width > 99999 ? 99999 : width) * 10 + (sp[k++] - '0');
            if (k < sl && sp[k] == '.') {
                k++;
                prec = 0;
                while (k < sl && isdigit((unsigned char)sp[k]))
                    prec = (prec > 99999 ? 99999 : prec) * 10 + (sp[k++] - '0');
            }
            char type = k < sl ? sp[k] : 0;
            if (width > 4096 || prec > 4096) FAIL("format width too large");
            loom_jinja_buf_t t = {0};
            if (type == 'f' || type == 'e' || type == 'g' || type == 'd')
                fmt_one(cx, at, &t, type, "", -1, prec, v);
            else
                loom_jinja_write_str(cx, &t, v);
            if (!align) align = (v.t == JV_INT || v.t == JV_FLOAT) ? '>' : '<';
            size_t n = cps(t.p, t.len), pad = (size_t)width > n ? (size_t)width - n : 0;
            size_t left = align == '>' ? pad : align == '^' ? pad / 2 : 0;
            for (size_t q = 0; q < left; q++)
                loom_jinja_buf_putc(cx, &b, fill);
            loom_jinja_buf_put(cx, &b, t.p, t.len);
            for (size_t q = left; q < pad; q++)
                loom_jinja_buf_putc(cx, &b, fill);
        } else {
            loom_jinja_write_str(cx, &b, v);
        }
        i = e;
    }
    return loom_jinja_buf_take(cx, &b);
}

/* ---- methods ---- */
static const char *const k_str_methods[] = {
    "startswith", "endswith", "split",    "rsplit",     "strip",      "lstrip",  "rstrip",
    "replace",    "upper",    "lower",    "title",      "capitalize", "format",  "find",
    "rfind",      "count",    "join",     "isdigit",    "isalpha",    "isalnum", "isspace",
    "islower",    "isupper",  "swapcase", "splitlines", "index",      "rindex",  NULL};
static const char *const k_dict_methods[] = {"items", "keys", "values", "get", "copy", NULL};
static const char *const k_dict_unsafe[] = {"pop",   "popitem",    "update",
                                            "clear", "setdefault", NULL};
static const char *const k_list_methods[] = {"index", "count", "copy", NULL};
static const char *const k_list_unsafe[] = {"append", "pop",  "extend",  "insert", "remove",
                                            "clear",  "sort", "reverse", NULL};

static int find_name(const char *const *tab, const char *name, size_t len) {
    for (int i = 0; tab[i]; i++)
        if (strlen(tab[i]) == len && memcmp(tab[i], name, len) == 0) return i;
    return -1;
}

jv_t loom_jinja_method(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj,
                       const char *name, size_t len) {
    const char *const *tab = obj.t == JV_STR    ? k_str_methods
                             : obj.t == JV_DICT ? k_dict_methods
                             : obj.t == JV_LIST ? k_list_methods
                                                : NULL;
    const char *const *unsafe = obj.t == JV_DICT   ? k_dict_unsafe
                                : obj.t == JV_LIST ? k_list_unsafe
                                                   : NULL;
    if (!tab) return undef();
    int id = find_name(tab, name, len);
    if (id < 0) {
        if (unsafe && find_name(unsafe, name, len) >= 0)
            FAIL("access to attribute '%.*s' of '%s' object is unsafe.", (int)len, name,
                 loom_jinja_type_name(obj));
        return undef();
    }
    loom_jinja_func_t *f = loom_jinja_alloc(cx, sizeof *f);
    memset(f, 0, sizeof *f);
    f->kind = JF_METHOD;
    f->id = id;
    f->self = obj;
    return (jv_t){.t = JV_FUNC, .u.fn = f};
}

static bool starts_ends(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_str_t *s,
                        jv_t x, bool end) {
    if (x.t == JV_LIST && x.u.l->tuple) {
        for (size_t i = 0; i < x.u.l->n; i++)
            if (starts_ends(cx, at, s, x.u.l->v[i], end)) return true;
        return false;
    }
    loom_jinja_str_t *p = need_str(cx, at, x, end ? "endswith" : "startswith");
    if (p->len > s->len) return false;
    return memcmp(end ? s->p + s->len - p->len : s->p, p->p, p->len) == 0;
}

static bool char_class(loom_jinja_str_t *s, int (*pred)(int)) {
    if (!s->len) return false;
    for (size_t i = 0; i < s->len; i++)
        if (!pred((unsigned char)s->p[i])) return false;
    return true;
}

jv_t loom_jinja_call_method(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                            loom_jinja_func_t *fn, loom_jinja_args_t *a) {
    jv_t self = fn->self;
    if (self.t == JV_STR) {
        loom_jinja_str_t *s = self.u.s;
        const char *m = k_str_methods[fn->id];
        if (STREQ(m, "startswith") || STREQ(m, "endswith"))
            return loom_jinja_bool(starts_ends(cx, at, s, arg(a, 0, NULL, undef()), m[0] == 'e'));
        if (STREQ(m, "split") || STREQ(m, "rsplit")) {
            jv_t sep = arg(a, 0, "sep", none());
            int64_t ms = need_int(cx, at, arg(a, 1, "maxsplit", loom_jinja_int(-1)), "maxsplit");
            if (m[0] == 'r' && ms >= 0) {
                /* rsplit with a limit: split all, then rejoin the front */
                jv_t all = split(cx, at, s, sep, -1);
                if ((int64_t)all.u.l->n - 1 <= ms) return all;
                if (sep.t != JV_STR)
                    FAIL("rsplit without a separator and with maxsplit is not supported");
                size_t keep = all.u.l->n - (size_t)ms;
                size_t endb = 0;
                for (size_t i = 0; i < keep; i++)
                    endb += all.u.l->v[i].u.s->len + (i ? sep.u.s->len : 0);
                jv_t r = loom_jinja_list_new(cx, (size_t)ms + 1);
                loom_jinja_list_push(cx, r.u.l, loom_jinja_substr(cx, s, 0, endb));
                for (size_t i = keep; i < all.u.l->n; i++)
                    loom_jinja_list_push(cx, r.u.l, all.u.l->v[i]);
                return r;
            }
            return split(cx, at, s, sep, ms);
        }
        if (STREQ(m, "strip")) return strip(cx, at, self, arg(a, 0, "chars", none()), true, true);
        if (STREQ(m, "lstrip")) return strip(cx, at, self, arg(a, 0, "chars", none()), true, false);
        if (STREQ(m, "rstrip")) return strip(cx, at, self, arg(a, 0, "chars", none()), false, true);
        if (STREQ(m, "replace")) {
            jv_t c = arg(a, 2, "count", loom_jinja_int(-1));
            return replace(cx, s, need_str(cx, at, arg(a, 0, NULL, undef()), "replace"),
                           need_str(cx, at, arg(a, 1, NULL, undef()), "replace"),
                           need_int(cx, at, c, "replace"));
        }
        if (STREQ(m, "upper")) return map_case(cx, s, 1);
        if (STREQ(m, "lower")) return map_case(cx, s, 0);
        if (STREQ(m, "capitalize")) return map_case(cx, s, 2);
        if (STREQ(m, "swapcase")) return map_case(cx, s, 3);
        if (STREQ(m, "title")) return map_case(cx, s, 4);
        if (STREQ(m, "format")) return str_format(cx, at, s, a);
        if (STREQ(m, "find") || STREQ(m, "rfind") || STREQ(m, "index") || STREQ(m, "rindex")) {
            loom_jinja_str_t *sub = need_str(cx, at, arg(a, 0, NULL, undef()), m);
            int64_t r = find(s, sub, 0, m[0] == 'r');
            if (r < 0 && (STREQ(m, "index") || STREQ(m, "rindex"))) FAIL("substring not found");
            return loom_jinja_int(r < 0 ? -1 : (int64_t)cps(s->p, (size_t)r));
        }
        if (STREQ(m, "count")) {
            loom_jinja_str_t *sub = need_str(cx, at, arg(a, 0, NULL, undef()), "count");
            if (!sub->len) return loom_jinja_int((int64_t)cps(s->p, s->len) + 1);
            int64_t n = 0;
            for (int64_t f = find(s, sub, 0, false); f >= 0;
                 f = find(s, sub, (size_t)f + sub->len, false))
                n++;
            return loom_jinja_int(n);
        }
        if (STREQ(m, "join")) return join(cx, at, arg(a, 0, NULL, undef()), s, none(), true);
        if (STREQ(m, "isdigit")) return loom_jinja_bool(char_class(s, isdigit));
        if (STREQ(m, "isalpha")) return loom_jinja_bool(char_class(s, isalpha));
        if (STREQ(m, "isalnum")) return loom_jinja_bool(char_class(s, isalnum));
        if (STREQ(m, "isspace")) {
            bool all = s->len > 0;
            for (size_t i = 0, w; i < s->len && all; i += w)
                all = (w = ws_at(s->p, s->len, i)) != 0;
            return loom_jinja_bool(all);
        }
        if (STREQ(m, "islower") || STREQ(m, "isupper")) {
            loom_jinja_node_t dummy = *at;
            return loom_jinja_bool(
                loom_jinja_test(cx, NULL, &dummy, m[2] == 'l' ? "lower" : "upper", self, a));
        }
        if (STREQ(m, "splitlines")) {
            jv_t r = loom_jinja_list_new(cx, 4);
            size_t i = 0;
            while (i < s->len) {
                size_t j = i, lb = 0;
                while (j < s->len && !(lb = line_break_at(s->p, s->len, j)))
                    j++;
                loom_jinja_list_push(cx, r.u.l, loom_jinja_substr(cx, s, i, j));
                i = j + lb;
            }
            return r;
        }
    } else if (self.t == JV_DICT) {
        const char *m = k_dict_methods[fn->id];
        if (STREQ(m, "items")) return items_of(cx, at, self);
        if (STREQ(m, "keys") || STREQ(m, "values")) {
            jv_t r = loom_jinja_list_new(cx, self.u.d->n);
            for (size_t i = 0; i < self.u.d->n; i++)
                r.u.l->v[r.u.l->n++] = m[0] == 'k' ? self.u.d->k[i] : self.u.d->v[i];
            return r;
        }
        if (STREQ(m, "get")) {
            jv_t *v = loom_jinja_dict_get(self.u.d, arg(a, 0, NULL, undef()));
            return v ? *v : arg(a, 1, NULL, none());
        }
        if (STREQ(m, "copy")) {
            jv_t r = loom_jinja_dict_new(cx, self.u.d->n);
            for (size_t i = 0; i < self.u.d->n; i++)
                loom_jinja_dict_set(cx, r.u.d, self.u.d->k[i], self.u.d->v[i]);
            return r;
        }
    } else if (self.t == JV_LIST) {
        const char *m = k_list_methods[fn->id];
        jv_t x = arg(a, 0, NULL, undef());
        if (STREQ(m, "index")) {
            for (size_t i = 0; i < self.u.l->n; i++)
                if (loom_jinja_eq(self.u.l->v[i], x)) return loom_jinja_int((int64_t)i);
            FAIL("value is not in list");
        }
        if (STREQ(m, "count")) {
            int64_t n = 0;
            for (size_t i = 0; i < self.u.l->n; i++)
                n += loom_jinja_eq(self.u.l->v[i], x);
            return loom_jinja_int(n);
        }
        if (STREQ(m, "copy")) {
            jv_t r = loom_jinja_list_new(cx, self.u.l->n);
            if (self.u.l->n) memcpy(r.u.l->v, self.u.l->v, self.u.l->n * sizeof(jv_t));
            r.u.l->n = self.u.l->n;
            return r;
        }
    }
    FAIL("method not supported");
}

/* ---- globals ---- */
int loom_jinja_global_id(const char *name, size_t len) {
    static const struct {
        const char *n;
        int id;
    } g[] = {{"range", JG_RANGE},           {"namespace", JG_NAMESPACE},   {"dict", JG_DICT},
             {"raise_exception", JG_RAISE}, {"strftime_now", JG_STRFTIME}, {NULL, 0}};
    for (int i = 0; g[i].n; i++)
        if (strlen(g[i].n) == len && memcmp(g[i].n, name, len) == 0) return g[i].id;
    return 0;
}

jv_t loom_jinja_call_global(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                            loom_jinja_func_t *fn, loom_jinja_args_t *a) {
    switch (fn->id) {
    case JG_RANGE: {
        int64_t start = 0, stop, step = 1;
        if (a->n == 1)
            stop = need_int(cx, at, a->v[0], "range");
        else if (a->n == 2 || a->n == 3) {
            start = need_int(cx, at, a->v[0], "range");
            stop = need_int(cx, at, a->v[1], "range");
            if (a->n == 3) step = need_int(cx, at, a->v[2], "range");
        } else
            FAIL("range expected 1 to 3 arguments, got %d", a->n);
        if (step == 0) FAIL("range() arg 3 must not be zero");
        double n = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                            : ceil(((double)start - (double)stop) / (double)-step);
        if (n < 0) n = 0;
        if (n > 100000)
            FAIL("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        jv_t r = loom_jinja_list_new(cx, (size_t)n);
        for (int64_t i = 0; i < (int64_t)n; i++)
            r.u.l->v[r.u.l->n++] = loom_jinja_int(start + i * step);
        r.u.l->range = true;
        r.u.l->r_start = start, r.u.l->r_stop = stop, r.u.l->r_step = step;
        return r;
    }
    case JG_NAMESPACE:
    case JG_DICT: {
        jv_t d = loom_jinja_dict_new(cx, 4);
        for (int i = 0; i < a->n; i++) {
            if (a->v[i].t != JV_DICT)
                FAIL("%s: positional arguments must be mappings",
                     fn->id == JG_DICT ? "dict" : "namespace");
            for (size_t k = 0; k < a->v[i].u.d->n; k++)
                loom_jinja_dict_set(cx, d.u.d, a->v[i].u.d->k[k], a->v[i].u.d->v[k]);
        }
        for (int k = 0; k < a->nkw; k++)
            loom_jinja_dict_set(cx, d.u.d, loom_jinja_str_c(cx, a->kwn[k]), a->kwv[k]);
        if (fn->id == JG_NAMESPACE) d.t = JV_NS;
        return d;
    }
    case JG_RAISE: {
        jv_t m = loom_jinja_to_str(cx, arg(a, 0, "message", loom_jinja_str_c(cx, "")));
        loom_jinja_raise(cx, m.u.s->p, m.u.s->len);
    }
    case JG_STRFTIME: {
        loom_jinja_str_t *f = need_str(cx, at, arg(a, 0, "format", undef()), "strftime_now");
        char fmt[256], out[512];
        if (f->len >= sizeof fmt) FAIL("strftime_now: format too long");
        memcpy(fmt, f->p, f->len);
        fmt[f->len] = '\0';
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        size_t n = strftime(out, sizeof out, fmt, &tm);
        char *p = loom_jinja_alloc(cx, n + 1);
        memcpy(p, out, n + 1);
        return loom_jinja_str(cx, p, n, false);
    }
    case JG_CHANGED: {
        loom_jinja_loop_t *l = fn->self.u.loop;
        jv_t t = loom_jinja_list_new(cx, (size_t)a->n);
        for (int i = 0; i < a->n; i++)
            t.u.l->v[t.u.l->n++] = a->v[i];
        bool changed = !l->changed_seen || !loom_jinja_eq(l->changed_last, t);
        l->changed_seen = true;
        l->changed_last = t;
        return loom_jinja_bool(changed);
    }
    case JG_CYCLE: {
        if (a->n == 0) FAIL("no items for cycling given");
        int64_t i = fn->self.u.loop->index0 % a->n;
        return a->v[i];
    }
    }
    FAIL("not callable");
}

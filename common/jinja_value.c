/* Jinja run-time values: the per-render arena, strings with their data
 * spans, lists and dicts, conversion from cJSON, truth and equality as
 * Python has them, and str()/repr()/json.dumps() of a value. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jinja_impl.h"

struct loom_jinja_arena_blk {
    struct loom_jinja_arena_blk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};

void *loom_jinja_alloc(loom_jinja_ctx_t *cx, size_t n) {
    loom_jinja_arena_t *a = &cx->arena;
    n = (n + 15) & ~(size_t)15;
    struct loom_jinja_arena_blk *b = a->head;
    if (!b || b->used + n > b->cap) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->used + cap > a->limit)
            loom_jinja_fail(cx, NULL, LOOM_ERR_RESOURCE_EXHAUSTED,
                            "memory limit: the template used more than %zu MiB", a->limit >> 20);
        b = malloc(sizeof *b + cap);
        if (!b) loom_jinja_fail(cx, NULL, LOOM_ERR_NOMEM, "out of memory rendering the template");
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
        a->used += cap;
    }
    void *r = b->data + b->used;
    b->used += n;
    return r;
}

/* Grows the arena block P of OLD bytes to NEW bytes, in place when it is the last allocation. */
static void *arena_grow(loom_jinja_ctx_t *cx, void *p, size_t old, size_t new_) {
    struct loom_jinja_arena_blk *b = cx->arena.head;
    size_t o16 = (old + 15) & ~(size_t)15, n16 = (new_ + 15) & ~(size_t)15;
    if (p && b && (char *)p + o16 == b->data + b->used && b->used - o16 + n16 <= b->cap) {
        b->used = b->used - o16 + n16;
        return p;
    }
    void *q = loom_jinja_alloc(cx, new_);
    if (old) memcpy(q, p, old);
    return q;
}

void loom_jinja_arena_free(loom_jinja_arena_t *a);
void loom_jinja_arena_free(loom_jinja_arena_t *a) {
    while (a->head) {
        struct loom_jinja_arena_blk *n = a->head->next;
        free(a->head);
        a->head = n;
    }
    a->used = 0;
}

jv_t loom_jinja_undef(const char *name) {
    return (jv_t){.t = JV_UNDEF, .u.uname = name};
}
jv_t loom_jinja_none(void) {
    return (jv_t){.t = JV_NONE};
}
jv_t loom_jinja_bool(bool b) {
    return (jv_t){.t = JV_BOOL, .u.b = b};
}
jv_t loom_jinja_int(int64_t i) {
    return (jv_t){.t = JV_INT, .u.i = i};
}
jv_t loom_jinja_float(double f) {
    return (jv_t){.t = JV_FLOAT, .u.f = f};
}

jv_t loom_jinja_str(loom_jinja_ctx_t *cx, const char *p, size_t len, bool data) {
    loom_jinja_str_t *s = loom_jinja_alloc(cx, sizeof *s + (data ? sizeof(loom_jinja_span_t) : 0));
    s->p = p;
    s->len = len;
    s->nsp = 0;
    s->sp = NULL;
    if (data && len && cx->track_spans) {
        s->sp = (loom_jinja_span_t *)(s + 1);
        s->sp[0] = (loom_jinja_span_t){0, len};
        s->nsp = 1;
    }
    return (jv_t){.t = JV_STR, .u.s = s};
}

jv_t loom_jinja_str_c(loom_jinja_ctx_t *cx, const char *p) {
    return loom_jinja_str(cx, p, strlen(p), false);
}

jv_t loom_jinja_substr(loom_jinja_ctx_t *cx, const loom_jinja_str_t *s, size_t a, size_t b) {
    if (a == 0 && b == s->len) return (jv_t){.t = JV_STR, .u.s = (loom_jinja_str_t *)s};
    jv_t r = loom_jinja_str(cx, s->p + a, b - a, false);
    if (s->nsp) {
        loom_jinja_span_t *sp = loom_jinja_alloc(cx, s->nsp * sizeof *sp);
        uint32_t n = 0;
        for (uint32_t k = 0; k < s->nsp; k++) {
            size_t x = s->sp[k].begin > a ? s->sp[k].begin : a,
                   y = s->sp[k].end < b ? s->sp[k].end : b;
            if (x < y) sp[n++] = (loom_jinja_span_t){x - a, y - a};
        }
        r.u.s->sp = sp;
        r.u.s->nsp = n;
    }
    return r;
}

jv_t loom_jinja_list_new(loom_jinja_ctx_t *cx, size_t cap) {
    loom_jinja_list_t *l = loom_jinja_alloc(cx, sizeof *l);
    l->n = 0;
    l->cap = cap;
    l->tuple = false;
    l->range = false;
    l->v = cap ? loom_jinja_alloc(cx, cap * sizeof(jv_t)) : NULL;
    return (jv_t){.t = JV_LIST, .u.l = l};
}

void loom_jinja_list_push(loom_jinja_ctx_t *cx, loom_jinja_list_t *l, jv_t v) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        l->v = arena_grow(cx, l->v, l->n * sizeof(jv_t), cap * sizeof(jv_t));
        l->cap = cap;
    }
    l->v[l->n++] = v;
}

jv_t loom_jinja_dict_new(loom_jinja_ctx_t *cx, size_t cap) {
    loom_jinja_dict_t *d = loom_jinja_alloc(cx, sizeof *d);
    d->n = 0;
    d->cap = cap;
    d->k = cap ? loom_jinja_alloc(cx, cap * sizeof(jv_t)) : NULL;
    d->v = cap ? loom_jinja_alloc(cx, cap * sizeof(jv_t)) : NULL;
    return (jv_t){.t = JV_DICT, .u.d = d};
}

jv_t *loom_jinja_dict_get_s(const loom_jinja_dict_t *d, const char *k, size_t len) {
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JV_STR && d->k[i].u.s->len == len && memcmp(d->k[i].u.s->p, k, len) == 0)
            return &d->v[i];
    return NULL;
}

jv_t *loom_jinja_dict_get(const loom_jinja_dict_t *d, jv_t k) {
    if (k.t == JV_STR) return loom_jinja_dict_get_s(d, k.u.s->p, k.u.s->len);
    for (size_t i = 0; i < d->n; i++)
        if (loom_jinja_eq(d->k[i], k)) return &d->v[i];
    return NULL;
}

void loom_jinja_dict_set(loom_jinja_ctx_t *cx, loom_jinja_dict_t *d, jv_t k, jv_t v) {
    jv_t *slot = loom_jinja_dict_get(d, k);
    if (slot) {
        *slot = v;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        d->k = arena_grow(cx, d->k, d->n * sizeof(jv_t), cap * sizeof(jv_t));
        d->v = arena_grow(cx, d->v, d->n * sizeof(jv_t), cap * sizeof(jv_t));
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

jv_t loom_jinja_from_json(loom_jinja_ctx_t *cx, const cJSON *j) {
    if (!j || cJSON_IsNull(j)) return loom_jinja_none();
    if (cJSON_IsBool(j)) return loom_jinja_bool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double f = j->valuedouble;
        if (f == floor(f) && fabs(f) < 9.2e18) return loom_jinja_int((int64_t)f);
        return loom_jinja_float(f);
    }
    if (cJSON_IsString(j)) return loom_jinja_str(cx, j->valuestring, strlen(j->valuestring), true);
    if (cJSON_IsArray(j)) {
        jv_t l = loom_jinja_list_new(cx, (size_t)cJSON_GetArraySize(j));
        for (const cJSON *c = j->child; c; c = c->next)
            loom_jinja_list_push(cx, l.u.l, loom_jinja_from_json(cx, c));
        return l;
    }
    if (cJSON_IsObject(j)) {
        jv_t d = loom_jinja_dict_new(cx, (size_t)cJSON_GetArraySize(j));
        for (const cJSON *c = j->child; c; c = c->next)
            loom_jinja_dict_set(cx, d.u.d, loom_jinja_str(cx, c->string, strlen(c->string), true),
                                loom_jinja_from_json(cx, c));
        return d;
    }
    return loom_jinja_none();
}

bool loom_jinja_truthy(jv_t v) {
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE:
        return false;
    case JV_BOOL:
        return v.u.b;
    case JV_INT:
        return v.u.i != 0;
    case JV_FLOAT:
        return v.u.f != 0;
    case JV_STR:
        return v.u.s->len > 0;
    case JV_LIST:
        return v.u.l->n > 0;
    case JV_DICT:
        return v.u.d->n > 0;
    default:
        return true;
    }
}

static bool is_num(jv_t v) {
    return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL;
}
static double num_f(jv_t v) {
    return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b;
}
static int64_t num_i(jv_t v) {
    return v.t == JV_INT ? v.u.i : (int64_t)v.u.b;
}

/* Python's ==; past 1000 levels of nesting (where Python raises
 * RecursionError) the values count as different. */
static bool eq_depth(jv_t a, jv_t b, int depth) {
    if (depth > 1000) return false;
    if (is_num(a) && is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT) return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE:
        return true;
    case JV_STR:
        return a.u.s->len == b.u.s->len && memcmp(a.u.s->p, b.u.s->p, a.u.s->len) == 0;
    case JV_LIST:
        if (a.u.l == b.u.l) return true;
        if (a.u.l->n != b.u.l->n || a.u.l->tuple != b.u.l->tuple) return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!eq_depth(a.u.l->v[i], b.u.l->v[i], depth + 1)) return false;
        return true;
    case JV_DICT:
    case JV_NS:
        if (a.u.d == b.u.d) return true;
        if (a.t == JV_NS || a.u.d->n != b.u.d->n) return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            jv_t *o = loom_jinja_dict_get(b.u.d, a.u.d->k[i]);
            if (!o || !eq_depth(a.u.d->v[i], *o, depth + 1)) return false;
        }
        return true;
    case JV_FUNC:
        return a.u.fn == b.u.fn;
    case JV_LOOP:
        return a.u.loop == b.u.loop;
    default:
        return false;
    }
}

bool loom_jinja_eq(jv_t a, jv_t b) {
    return eq_depth(a, b, 0);
}

const char *loom_jinja_type_name(jv_t v) {
    switch (v.t) {
    case JV_UNDEF:
        return "Undefined";
    case JV_NONE:
        return "NoneType";
    case JV_BOOL:
        return "bool";
    case JV_INT:
        return "int";
    case JV_FLOAT:
        return "float";
    case JV_STR:
        return "str";
    case JV_LIST:
        return v.u.l->tuple ? "tuple" : "list";
    case JV_DICT:
        return "dict";
    case JV_FUNC:
        return "function";
    case JV_NS:
        return "Namespace";
    case JV_LOOP:
        return "LoopContext";
    }
    return "object";
}

static int cmp_depth(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t a, jv_t b, int depth);

int loom_jinja_cmp(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t a, jv_t b) {
    return cmp_depth(cx, at, a, b, 0);
}

static int cmp_depth(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t a, jv_t b, int depth) {
    if (depth > 1000)
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "values nested too deeply to compare");
    if (is_num(a) && is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT) {
            double x = num_f(a), y = num_f(b);
            return x < y ? -1 : x > y ? 1 : 0;
        }
        int64_t x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->p, b.u.s->p, n);
        if (c) return c < 0 ? -1 : 1;
        return a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len ? 1 : 0;
    }
    if (a.t == JV_LIST && b.t == JV_LIST && a.u.l->tuple == b.u.l->tuple) {
        size_t n = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (loom_jinja_eq(a.u.l->v[i], b.u.l->v[i])) continue;
            return cmp_depth(cx, at, a.u.l->v[i], b.u.l->v[i], depth + 1);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n ? 1 : 0;
    }
    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                    "'<' not supported between instances of '%s' and '%s'", loom_jinja_type_name(a),
                    loom_jinja_type_name(b));
}

/* ---- buffers ---- */
static void buf_reserve(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, size_t n) {
    if (b->len + n <= b->cap) return;
    if (b->len + n > cx->max_output)
        loom_jinja_fail(cx, NULL, LOOM_ERR_RESOURCE_EXHAUSTED,
                        "max_output: the output (or a string) exceeds %zu bytes", cx->max_output);
    size_t cap = b->cap ? b->cap * 2 : 64;
    while (cap < b->len + n + 1)
        cap *= 2;
    b->p = arena_grow(cx, b->p, b->len, cap);
    b->cap = cap;
}

void loom_jinja_buf_put(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const char *p, size_t n) {
    if (!n) return;
    buf_reserve(cx, b, n);
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

void loom_jinja_buf_putc(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, char c) {
    buf_reserve(cx, b, 1);
    b->p[b->len++] = c;
}

static void buf_span(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, size_t x, size_t y) {
    if (b->nsp && b->sp[b->nsp - 1].end == x) {
        b->sp[b->nsp - 1].end = y;
        return;
    }
    if (b->nsp == b->spcap) {
        size_t cap = b->spcap ? b->spcap * 2 : 8;
        b->sp = arena_grow(cx, b->sp, b->nsp * sizeof *b->sp, cap * sizeof *b->sp);
        b->spcap = cap;
    }
    b->sp[b->nsp++] = (loom_jinja_span_t){x, y};
}

void loom_jinja_buf_put_str(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const loom_jinja_str_t *s) {
    size_t base = b->len;
    loom_jinja_buf_put(cx, b, s->p, s->len);
    for (uint32_t k = 0; k < s->nsp; k++)
        buf_span(cx, b, base + s->sp[k].begin, base + s->sp[k].end);
}

void loom_jinja_buf_printf(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) loom_jinja_buf_put(cx, b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

jv_t loom_jinja_buf_take(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b) {
    jv_t r = loom_jinja_str(cx, b->p ? b->p : "", b->len, false);
    r.u.s->sp = b->sp;
    r.u.s->nsp = (uint32_t)b->nsp;
    memset(b, 0, sizeof *b);
    return r;
}

/* ---- str / repr ---- */
void loom_jinja_write_float(loom_jinja_buf_t *b, loom_jinja_ctx_t *cx, double f) {
    if (isnan(f)) {
        loom_jinja_buf_put(cx, b, "nan", 3);
        return;
    }
    if (isinf(f)) {
        loom_jinja_buf_put(cx, b, f < 0 ? "-inf" : "inf", f < 0 ? 4 : 3);
        return;
    }
    char tmp[64];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp is [-]d[.ddd]e[+-]XX: pull the digits and the exponent */
    char digits[32];
    int nd = 0, neg = 0;
    const char *s = tmp;
    if (*s == '-') {
        neg = 1;
        s++;
    }
    for (; *s && *s != 'e'; s++)
        if (*s != '.') digits[nd++] = *s;
    int e = atoi(s + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    char out[64];
    int n = 0;
    if (neg) out[n++] = '-';
    if (e >= -5 + 1 && e < 16) {
        if (e >= 0) {
            for (int i = 0; i <= e; i++)
                out[n++] = i < nd ? digits[i] : '0';
            out[n++] = '.';
            if (nd > e + 1)
                for (int i = e + 1; i < nd; i++)
                    out[n++] = digits[i];
            else
                out[n++] = '0';
        } else {
            out[n++] = '0';
            out[n++] = '.';
            for (int i = 0; i < -e - 1; i++)
                out[n++] = '0';
            for (int i = 0; i < nd; i++)
                out[n++] = digits[i];
        }
    } else {
        out[n++] = digits[0];
        if (nd > 1) {
            out[n++] = '.';
            for (int i = 1; i < nd; i++)
                out[n++] = digits[i];
        }
        n +=
            snprintf(out + n, sizeof out - (size_t)n, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
    loom_jinja_buf_put(cx, b, out, (size_t)n);
}

/* Code points Python's repr escapes besides ASCII controls: the C1 controls,
 * separators other than the space, and common format characters. */
static bool repr_escapes(uint32_t c) {
    return (c >= 0x80 && c <= 0xA0) || c == 0xAD || c == 0x1680 || (c >= 0x2000 && c <= 0x200F) ||
           (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x2064) ||
           (c >= 0x2066 && c <= 0x206F) || c == 0x3000 || c == 0xFEFF ||
           (c >= 0xFFF9 && c <= 0xFFFB) || (c >= 0xD800 && c <= 0xDFFF);
}

static void write_str_repr(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const char *p, size_t len) {
    bool has_sq = memchr(p, '\'', len) != NULL, has_dq = memchr(p, '"', len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    loom_jinja_buf_putc(cx, b, q);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c == (unsigned char)q || c == '\\') {
            loom_jinja_buf_putc(cx, b, '\\');
            loom_jinja_buf_putc(cx, b, (char)c);
        } else if (c == '\n') {
            loom_jinja_buf_put(cx, b, "\\n", 2);
        } else if (c == '\r') {
            loom_jinja_buf_put(cx, b, "\\r", 2);
        } else if (c == '\t') {
            loom_jinja_buf_put(cx, b, "\\t", 2);
        } else if (c < 0x20 || c == 0x7f) {
            loom_jinja_buf_printf(cx, b, "\\x%02x", c);
        } else if (c >= 0xC2 && c <= 0xEF) {
            size_t l = c < 0xE0 ? 2 : 3;
            uint32_t cp = l == 2 ? (c & 0x1Fu) : (c & 0x0Fu);
            bool ok = i + l <= len;
            for (size_t k = 1; ok && k < l; k++) {
                unsigned char d = (unsigned char)p[i + k];
                ok = (d & 0xC0) == 0x80;
                cp = (cp << 6) | (d & 0x3Fu);
            }
            if (ok && repr_escapes(cp)) {
                if (cp < 0x100)
                    loom_jinja_buf_printf(cx, b, "\\x%02x", cp);
                else
                    loom_jinja_buf_printf(cx, b, "\\u%04x", cp);
                i += l - 1;
            } else {
                loom_jinja_buf_putc(cx, b, (char)c);
            }
        } else {
            loom_jinja_buf_putc(cx, b, (char)c);
        }
    }
    loom_jinja_buf_putc(cx, b, q);
}

static void write_repr_inner(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, jv_t v);

/* Enters container P for printing: false when it is already being printed (a cycle). */
static bool repr_enter(loom_jinja_ctx_t *cx, const void *p) {
    for (int i = 0; i < cx->repr_depth; i++)
        if (cx->repr_stack[i] == p) return false;
    if (cx->repr_depth == (int)(sizeof cx->repr_stack / sizeof cx->repr_stack[0]))
        loom_jinja_fail(cx, NULL, LOOM_ERR_INVALID_ARGUMENT, "a value nested too deeply to print");
    cx->repr_stack[cx->repr_depth++] = p;
    return true;
}

void loom_jinja_write_repr(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, jv_t v) {
    if ((v.t == JV_LIST && !v.u.l->range) || v.t == JV_DICT) {
        if (!repr_enter(cx, v.t == JV_LIST ? (const void *)v.u.l : (const void *)v.u.d)) {
            if (v.t == JV_DICT)
                loom_jinja_buf_put(cx, b, "{...}", 5);
            else
                loom_jinja_buf_put(cx, b, v.u.l->tuple ? "(...)" : "[...]", 5);
            return;
        }
        write_repr_inner(cx, b, v);
        cx->repr_depth--;
        return;
    }
    write_repr_inner(cx, b, v);
}

static void write_repr_inner(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, jv_t v) {
    switch (v.t) {
    case JV_STR:
        write_str_repr(cx, b, v.u.s->p, v.u.s->len);
        return;
    case JV_UNDEF:
        loom_jinja_buf_put(cx, b, "Undefined", 9);
        return;
    case JV_LIST: {
        if (v.u.l->range) {
            loom_jinja_buf_printf(cx, b, "range(%lld, %lld", (long long)v.u.l->r_start,
                                  (long long)v.u.l->r_stop);
            if (v.u.l->r_step != 1)
                loom_jinja_buf_printf(cx, b, ", %lld", (long long)v.u.l->r_step);
            loom_jinja_buf_putc(cx, b, ')');
            return;
        }
        loom_jinja_buf_putc(cx, b, v.u.l->tuple ? '(' : '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) loom_jinja_buf_put(cx, b, ", ", 2);
            loom_jinja_write_repr(cx, b, v.u.l->v[i]);
        }
        if (v.u.l->tuple && v.u.l->n == 1) loom_jinja_buf_putc(cx, b, ',');
        loom_jinja_buf_putc(cx, b, v.u.l->tuple ? ')' : ']');
        return;
    }
    case JV_DICT: {
        loom_jinja_buf_putc(cx, b, '{');
        for (size_t i = 0; i < v.u.d->n; i++) {
            if (i) loom_jinja_buf_put(cx, b, ", ", 2);
            loom_jinja_write_repr(cx, b, v.u.d->k[i]);
            loom_jinja_buf_put(cx, b, ": ", 2);
            loom_jinja_write_repr(cx, b, v.u.d->v[i]);
        }
        loom_jinja_buf_putc(cx, b, '}');
        return;
    }
    default:
        loom_jinja_write_str(cx, b, v);
    }
}

void loom_jinja_write_str(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, jv_t v) {
    switch (v.t) {
    case JV_UNDEF:
        return;
    case JV_NONE:
        loom_jinja_buf_put(cx, b, "None", 4);
        return;
    case JV_BOOL:
        if (v.u.b)
            loom_jinja_buf_put(cx, b, "True", 4);
        else
            loom_jinja_buf_put(cx, b, "False", 5);
        return;
    case JV_INT:
        loom_jinja_buf_printf(cx, b, "%lld", (long long)v.u.i);
        return;
    case JV_FLOAT:
        loom_jinja_write_float(b, cx, v.u.f);
        return;
    case JV_STR:
        loom_jinja_buf_put_str(cx, b, v.u.s);
        return;
    case JV_LIST:
    case JV_DICT:
        loom_jinja_write_repr(cx, b, v);
        return;
    case JV_NS: {
        loom_jinja_buf_put(cx, b, "<Namespace ", 11);
        jv_t d = v;
        d.t = JV_DICT;
        loom_jinja_write_repr(cx, b, d);
        loom_jinja_buf_putc(cx, b, '>');
        return;
    }
    case JV_FUNC:
        loom_jinja_buf_put(cx, b, "<function>", 10);
        return;
    case JV_LOOP:
        loom_jinja_buf_put(cx, b, "<LoopContext>", 13);
        return;
    }
}

jv_t loom_jinja_to_str(loom_jinja_ctx_t *cx, jv_t v) {
    if (v.t == JV_STR) return v;
    loom_jinja_buf_t b = {0};
    loom_jinja_write_str(cx, &b, v);
    return loom_jinja_buf_take(cx, &b);
}

/* ---- json.dumps ---- */
static void json_str(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const char *p, size_t len) {
    loom_jinja_buf_putc(cx, b, '"');
    size_t run = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        const char *esc = NULL;
        char tmp[8];
        switch (c) {
        case '"':
            esc = "\\\"";
            break;
        case '\\':
            esc = "\\\\";
            break;
        case '\n':
            esc = "\\n";
            break;
        case '\r':
            esc = "\\r";
            break;
        case '\t':
            esc = "\\t";
            break;
        case '\b':
            esc = "\\b";
            break;
        case '\f':
            esc = "\\f";
            break;
        default:
            if (c < 0x20) {
                snprintf(tmp, sizeof tmp, "\\u%04x", c);
                esc = tmp;
            }
        }
        if (esc) {
            loom_jinja_buf_put(cx, b, p + run, i - run);
            loom_jinja_buf_put(cx, b, esc, strlen(esc));
            run = i + 1;
        }
    }
    loom_jinja_buf_put(cx, b, p + run, len - run);
    loom_jinja_buf_putc(cx, b, '"');
}

static void json_nl(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, int indent, int level) {
    loom_jinja_buf_putc(cx, b, '\n');
    for (int i = 0; i < indent * level; i++)
        loom_jinja_buf_putc(cx, b, ' ');
}

static int key_cmp(const void *x, const void *y) {
    const jv_t *a = *(const jv_t *const *)x, *c = *(const jv_t *const *)y;
    size_t n = a->u.s->len < c->u.s->len ? a->u.s->len : c->u.s->len;
    int r = memcmp(a->u.s->p, c->u.s->p, n);
    if (r) return r;
    return a->u.s->len < c->u.s->len ? -1 : a->u.s->len > c->u.s->len;
}

void loom_jinja_write_json(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_buf_t *b,
                           jv_t v, int indent, const char *item_sep, const char *key_sep,
                           bool sort_keys, int level) {
    if (level > 512)
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "tojson: value nested too deeply");
    switch (v.t) {
    case JV_NONE:
        loom_jinja_buf_put(cx, b, "null", 4);
        return;
    case JV_BOOL:
        if (v.u.b)
            loom_jinja_buf_put(cx, b, "true", 4);
        else
            loom_jinja_buf_put(cx, b, "false", 5);
        return;
    case JV_INT:
        loom_jinja_buf_printf(cx, b, "%lld", (long long)v.u.i);
        return;
    case JV_FLOAT:
        if (isnan(v.u.f))
            loom_jinja_buf_put(cx, b, "NaN", 3);
        else if (isinf(v.u.f))
            loom_jinja_buf_put(cx, b, v.u.f < 0 ? "-Infinity" : "Infinity", v.u.f < 0 ? 9 : 8);
        else
            loom_jinja_write_float(b, cx, v.u.f);
        return;
    case JV_STR:
        json_str(cx, b, v.u.s->p, v.u.s->len);
        return;
    case JV_LIST:
        if (!v.u.l->n) {
            loom_jinja_buf_put(cx, b, "[]", 2);
            return;
        }
        loom_jinja_buf_putc(cx, b, '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) loom_jinja_buf_put(cx, b, item_sep, strlen(item_sep));
            if (indent >= 0) json_nl(cx, b, indent, level + 1);
            loom_jinja_write_json(cx, at, b, v.u.l->v[i], indent, item_sep, key_sep, sort_keys,
                                  level + 1);
        }
        if (indent >= 0) json_nl(cx, b, indent, level);
        loom_jinja_buf_putc(cx, b, ']');
        return;
    case JV_DICT: {
        if (!v.u.d->n) {
            loom_jinja_buf_put(cx, b, "{}", 2);
            return;
        }
        const jv_t **order = loom_jinja_alloc(cx, v.u.d->n * sizeof *order);
        for (size_t i = 0; i < v.u.d->n; i++) {
            order[i] = &v.u.d->k[i];
            if (v.u.d->k[i].t != JV_STR && sort_keys)
                loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                "tojson: sort_keys needs string keys");
        }
        if (sort_keys) qsort(order, v.u.d->n, sizeof *order, key_cmp);
        loom_jinja_buf_putc(cx, b, '{');
        for (size_t i = 0; i < v.u.d->n; i++) {
            size_t idx = (size_t)(order[i] - v.u.d->k);
            if (i) loom_jinja_buf_put(cx, b, item_sep, strlen(item_sep));
            if (indent >= 0) json_nl(cx, b, indent, level + 1);
            jv_t k = v.u.d->k[idx];
            if (k.t == JV_STR) {
                json_str(cx, b, k.u.s->p, k.u.s->len);
            } else if (k.t == JV_INT || k.t == JV_FLOAT || k.t == JV_BOOL || k.t == JV_NONE) {
                loom_jinja_buf_t kb = {0};
                loom_jinja_write_json(cx, at, &kb, k, -1, ", ", ": ", false, level + 1);
                json_str(cx, b, kb.p, kb.len);
            } else {
                loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                "tojson: keys must be str, int, float, bool or None, not %s",
                                loom_jinja_type_name(k));
            }
            loom_jinja_buf_put(cx, b, key_sep, strlen(key_sep));
            loom_jinja_write_json(cx, at, b, v.u.d->v[idx], indent, item_sep, key_sep, sort_keys,
                                  level + 1);
        }
        if (indent >= 0) json_nl(cx, b, indent, level);
        loom_jinja_buf_putc(cx, b, '}');
        return;
    }
    default:
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                        "Object of type %s is not JSON serializable", loom_jinja_type_name(v));
    }
}

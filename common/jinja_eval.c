/* Jinja evaluator: walks the syntax tree with a scope chain (a for loop's
 * iteration and a macro call each get a scope of their own, so a `set`
 * inside them does not leak out, as in jinja2), counts steps, and writes to
 * the current output buffer. Errors longjmp to the render entry. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jinja_impl.h"

void loom_jinja_arena_free(loom_jinja_arena_t *a);

enum { CTL_NONE, CTL_BREAK, CTL_CONTINUE };

/* The render's root: VARS, converted on first use. */
typedef struct root {
    const cJSON *vars;
    loom_jinja_dict_t *cache;
} root_t;

typedef struct ectx {
    loom_jinja_ctx_t cx;
    root_t root;
    int ctl;
} ectx_t;

_Noreturn void loom_jinja_fail(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                               loom_status_t code, const char *fmt, ...) {
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (at)
        loom_err_set(cx->err, code, "%s:%d:%d: %s", cx->t->name, at->line, at->col, what);
    else
        loom_err_set(cx->err, code, "%s: %s", cx->t->name, what);
    cx->status = code;
    longjmp(cx->jb, 1);
}

_Noreturn void loom_jinja_raise(loom_jinja_ctx_t *cx, const char *msg, size_t len) {
    loom_err_set(cx->err, LOOM_ERR_INVALID_ARGUMENT, "%.*s", (int)len, msg);
    cx->status = LOOM_ERR_INVALID_ARGUMENT;
    longjmp(cx->jb, 1);
}

void loom_jinja_step(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at) {
    if (++cx->steps > cx->max_steps)
        loom_jinja_fail(cx, at, LOOM_ERR_RESOURCE_EXHAUSTED,
                        "max_steps: the template ran more than %llu steps",
                        (unsigned long long)cx->max_steps);
}

/* ---- scopes ---- */
static loom_jinja_scope_t *scope_new(loom_jinja_ctx_t *cx, loom_jinja_scope_t *parent) {
    loom_jinja_scope_t *s = loom_jinja_alloc(cx, sizeof *s);
    memset(s, 0, sizeof *s);
    s->parent = parent;
    return s;
}

static void scope_set(loom_jinja_ctx_t *cx, loom_jinja_scope_t *s, const char *name, size_t len,
                      jv_t v) {
    for (int i = 0; i < s->n; i++)
        if (s->lens[i] == len && memcmp(s->names[i], name, len) == 0) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 4;
        jv_t *v2 = loom_jinja_alloc(cx, (size_t)cap * sizeof *v2);
        const char **n2 = loom_jinja_alloc(cx, (size_t)cap * sizeof *n2);
        size_t *l2 = loom_jinja_alloc(cx, (size_t)cap * sizeof *l2);
        if (s->n) {
            memcpy(v2, s->vals, (size_t)s->n * sizeof *v2);
            memcpy(n2, s->names, (size_t)s->n * sizeof *n2);
            memcpy(l2, s->lens, (size_t)s->n * sizeof *l2);
        }
        s->vals = v2, s->names = n2, s->lens = l2, s->cap = cap;
    }
    s->names[s->n] = name;
    s->lens[s->n] = len;
    s->vals[s->n++] = v;
}

static jv_t *scope_find(loom_jinja_scope_t *s, const char *name, size_t len) {
    for (; s; s = s->parent)
        for (int i = s->n - 1; i >= 0; i--)
            if (s->lens[i] == len && memcmp(s->names[i], name, len) == 0) return &s->vals[i];
    return NULL;
}

static jv_t lookup(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_node_t *n) {
    loom_jinja_ctx_t *cx = &ec->cx;
    jv_t *v = scope_find(sc, n->name, n->name_len);
    if (v) return *v;
    if (ec->root.cache) {
        jv_t *c = loom_jinja_dict_get_s(ec->root.cache, n->name, n->name_len);
        if (c) return *c;
    }
    if (ec->root.vars) {
        for (const cJSON *j = ec->root.vars->child; j; j = j->next)
            if (j->string && strlen(j->string) == n->name_len &&
                memcmp(j->string, n->name, n->name_len) == 0) {
                /* a top-level string (bos_token, eos_token, date_string) is configuration,
                 * not data: only what sits inside messages, tools, documents... is marked */
                jv_t r = cJSON_IsString(j)
                             ? loom_jinja_str(cx, j->valuestring, strlen(j->valuestring), false)
                             : loom_jinja_from_json(cx, j);
                if (!ec->root.cache) ec->root.cache = loom_jinja_dict_new(cx, 8).u.d;
                loom_jinja_dict_set(cx, ec->root.cache,
                                    loom_jinja_str(cx, n->name, n->name_len, false), r);
                return r;
            }
    }
    int g = loom_jinja_global_id(n->name, n->name_len);
    if (g) {
        loom_jinja_func_t *f = loom_jinja_alloc(cx, sizeof *f);
        memset(f, 0, sizeof *f);
        f->kind = JF_GLOBAL;
        f->id = g;
        return (jv_t){.t = JV_FUNC, .u.fn = f};
    }
    return loom_jinja_undef(n->name);
}

/* ---- attribute and item access (the sandbox: data only, and listed methods) ---- */
_Noreturn void loom_jinja_undefined_error(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                                          jv_t v) {
    if (v.u.uname && v.u.uname[0] == '!')
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "%s", v.u.uname + 1);
    if (v.u.uname)
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "'%s' is undefined", v.u.uname);
    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "a value is undefined");
}

static jv_t loop_attr(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj, const char *name,
                      size_t len) {
    loom_jinja_loop_t *l = obj.u.loop;
#define IS(s) (len == sizeof(s) - 1 && memcmp(name, s, len) == 0)
    if (IS("index")) return loom_jinja_int(l->index0 + 1);
    if (IS("index0")) return loom_jinja_int(l->index0);
    if (IS("revindex")) return loom_jinja_int(l->length - l->index0);
    if (IS("revindex0")) return loom_jinja_int(l->length - l->index0 - 1);
    if (IS("first")) return loom_jinja_bool(l->index0 == 0);
    if (IS("last")) return loom_jinja_bool(l->index0 == l->length - 1);
    if (IS("length")) return loom_jinja_int(l->length);
    if (IS("depth")) return loom_jinja_int(1);
    if (IS("depth0")) return loom_jinja_int(0);
    if (IS("previtem")) return l->has_prev ? l->prev : loom_jinja_undef("previtem");
    if (IS("nextitem")) return l->has_next ? l->next : loom_jinja_undef("nextitem");
    if (IS("cycle") || IS("changed")) {
        loom_jinja_func_t *f = loom_jinja_alloc(cx, sizeof *f);
        memset(f, 0, sizeof *f);
        f->kind = JF_GLOBAL;
        f->id = name[1] == 'y' ? JG_CYCLE : JG_CHANGED;
        f->self = obj;
        return (jv_t){.t = JV_FUNC, .u.fn = f};
    }
#undef IS
    (void)at;
    return loom_jinja_undef(NULL);
}

/* An undefined value that says, when used, which attribute OBJ lacked. */
static jv_t missing_attr(loom_jinja_ctx_t *cx, jv_t obj, const char *name, size_t len) {
    size_t n = len + 64;
    char *m = loom_jinja_alloc(cx, n);
    snprintf(m, n, "!'%s' has no attribute '%.*s'",
             obj.t == JV_NONE ? "None" : loom_jinja_type_name(obj), (int)len, name);
    return loom_jinja_undef(m);
}

jv_t loom_jinja_getattr(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj,
                        const char *name, size_t len) {
    jv_t r = loom_jinja_getattr_raw(cx, at, obj, name, len);
    if (r.t == JV_UNDEF && !r.u.uname) return missing_attr(cx, obj, name, len);
    return r;
}

jv_t loom_jinja_getattr_raw(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj,
                            const char *name, size_t len) {
    switch (obj.t) {
    case JV_UNDEF:
        loom_jinja_undefined_error(cx, at, obj);
    case JV_DICT: {
        jv_t m = loom_jinja_method(cx, at, obj, name, len);
        if (m.t != JV_UNDEF) return m;
        jv_t *v = loom_jinja_dict_get_s(obj.u.d, name, len);
        return v ? *v : loom_jinja_undef(NULL);
    }
    case JV_NS: {
        jv_t *v = loom_jinja_dict_get_s(obj.u.d, name, len);
        return v ? *v : loom_jinja_undef(NULL);
    }
    case JV_LOOP:
        return loop_attr(cx, at, obj, name, len);
    case JV_STR:
    case JV_LIST:
        return loom_jinja_method(cx, at, obj, name, len);
    default:
        return loom_jinja_undef(NULL);
    }
}

/* Python index of a code point in a UTF-8 string to a byte offset. */
static size_t cp_count(const loom_jinja_str_t *s) {
    size_t n = 0;
    for (size_t i = 0; i < s->len; i++)
        n += ((unsigned char)s->p[i] & 0xC0) != 0x80;
    return n;
}
static size_t cp_offset(const loom_jinja_str_t *s, size_t cp) {
    size_t i = 0, n = 0;
    for (; i < s->len; i++) {
        if (((unsigned char)s->p[i] & 0xC0) != 0x80) {
            if (n == cp) return i;
            n++;
        }
    }
    return s->len;
}

jv_t loom_jinja_getitem(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj, jv_t key) {
    switch (obj.t) {
    case JV_UNDEF:
        loom_jinja_undefined_error(cx, at, obj);
    case JV_DICT:
    case JV_NS: {
        jv_t *v = loom_jinja_dict_get(obj.u.d, key);
        if (v) return *v;
        if (key.t == JV_STR && obj.t == JV_DICT)
            return loom_jinja_method(cx, at, obj, key.u.s->p, key.u.s->len);
        return loom_jinja_undef(NULL);
    }
    case JV_LIST:
        if (key.t == JV_INT || key.t == JV_BOOL) {
            int64_t i = key.t == JV_INT ? key.u.i : key.u.b, n = (int64_t)obj.u.l->n;
            if (i < 0) i += n;
            if (i < 0 || i >= n) return loom_jinja_undef(NULL);
            return obj.u.l->v[i];
        }
        if (key.t == JV_STR) return loom_jinja_method(cx, at, obj, key.u.s->p, key.u.s->len);
        return loom_jinja_undef(NULL);
    case JV_STR:
        if (key.t == JV_INT || key.t == JV_BOOL) {
            int64_t i = key.t == JV_INT ? key.u.i : key.u.b, n = (int64_t)cp_count(obj.u.s);
            if (i < 0) i += n;
            if (i < 0 || i >= n) return loom_jinja_undef(NULL);
            size_t a = cp_offset(obj.u.s, (size_t)i), b = cp_offset(obj.u.s, (size_t)i + 1);
            return loom_jinja_substr(cx, obj.u.s, a, b);
        }
        if (key.t == JV_STR) return loom_jinja_method(cx, at, obj, key.u.s->p, key.u.s->len);
        return loom_jinja_undef(NULL);
    case JV_LOOP:
        if (key.t == JV_STR) return loop_attr(cx, at, obj, key.u.s->p, key.u.s->len);
        return loom_jinja_undef(NULL);
    default:
        return loom_jinja_undef(NULL);
    }
}

static int64_t slice_arg(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v, int64_t dflt) {
    if (v.t == JV_NONE || v.t == JV_UNDEF) return dflt;
    if (v.t == JV_INT) return v.u.i;
    if (v.t == JV_BOOL) return v.u.b;
    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "slice indices must be integers or None");
}

static jv_t do_slice(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj, jv_t lo, jv_t hi,
                     jv_t st) {
    if (obj.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, obj);
    if (obj.t != JV_LIST && obj.t != JV_STR) return loom_jinja_undef(NULL);
    int64_t step = slice_arg(cx, at, st, 1);
    if (step == 0) loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "slice step cannot be zero");
    bool ascii = true;
    int64_t n;
    if (obj.t == JV_LIST) {
        n = (int64_t)obj.u.l->n;
    } else {
        n = (int64_t)cp_count(obj.u.s);
        ascii = (size_t)n == obj.u.s->len;
    }
    int64_t a, b;
    if (step > 0) {
        a = slice_arg(cx, at, lo, 0);
        b = slice_arg(cx, at, hi, n);
        if (a < 0) a += n;
        if (a < 0) a = 0;
        if (a > n) a = n;
        if (b < 0) b += n;
        if (b < 0) b = 0;
        if (b > n) b = n;
    } else {
        a = slice_arg(cx, at, lo, n - 1);
        b = slice_arg(cx, at, hi, -n - 1);
        if (a < 0) a += n;
        if (a < -1) a = -1;
        if (a >= n) a = n - 1;
        if (b < 0) b += n;
        if (b < -1) b = -1;
        if (b >= n) b = n - 1;
    }
    if (obj.t == JV_STR && step == 1) {
        if (b < a) b = a;
        size_t x = ascii ? (size_t)a : cp_offset(obj.u.s, (size_t)a);
        size_t y = ascii ? (size_t)b : cp_offset(obj.u.s, (size_t)b);
        return loom_jinja_substr(cx, obj.u.s, x, y);
    }
    if (obj.t == JV_LIST) {
        jv_t r = loom_jinja_list_new(cx, 0);
        r.u.l->tuple = obj.u.l->tuple;
        for (int64_t i = a; step > 0 ? i < b : i > b;) {
            loom_jinja_step(cx, at);
            loom_jinja_list_push(cx, r.u.l, obj.u.l->v[i]);
            if (__builtin_add_overflow(i, step, &i)) break;
        }
        return r;
    }
    loom_jinja_buf_t buf = {0};
    for (int64_t i = a; step > 0 ? i < b : i > b;) {
        loom_jinja_step(cx, at);
        size_t x = ascii ? (size_t)i : cp_offset(obj.u.s, (size_t)i);
        size_t y = ascii ? (size_t)i + 1 : cp_offset(obj.u.s, (size_t)i + 1);
        loom_jinja_buf_put(cx, &buf, obj.u.s->p + x, y - x);
        if (__builtin_add_overflow(i, step, &i)) break;
    }
    return loom_jinja_buf_take(cx, &buf);
}

loom_jinja_list_t *loom_jinja_iterate(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v) {
    switch (v.t) {
    case JV_LIST:
        return v.u.l;
    case JV_DICT: {
        jv_t l = loom_jinja_list_new(cx, v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++)
            l.u.l->v[l.u.l->n++] = v.u.d->k[i];
        return l.u.l;
    }
    case JV_STR: {
        jv_t l = loom_jinja_list_new(cx, v.u.s->len);
        for (size_t i = 0; i < v.u.s->len;) {
            size_t j = i + 1;
            while (j < v.u.s->len && ((unsigned char)v.u.s->p[j] & 0xC0) == 0x80)
                j++;
            l.u.l->v[l.u.l->n++] = loom_jinja_substr(cx, v.u.s, i, j);
            i = j;
        }
        return l.u.l;
    }
    case JV_UNDEF:
        return loom_jinja_list_new(cx, 0).u.l; /* jinja2's Undefined iterates as empty */
    default:
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "'%s' object is not iterable",
                        loom_jinja_type_name(v));
    }
}

/* ---- arithmetic ---- */
static bool isnum(jv_t v) {
    return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL;
}
static double fval(jv_t v) {
    return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b;
}
static int64_t ival(jv_t v) {
    return v.t == JV_INT ? v.u.i : v.t == JV_BOOL ? (int64_t)v.u.b : 0;
}

static _Noreturn void op_error(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, const char *op,
                               jv_t a, jv_t b) {
    if (a.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, a);
    if (b.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, b);
    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                    "unsupported operand type(s) for %s: '%s' and '%s'", op,
                    loom_jinja_type_name(a), loom_jinja_type_name(b));
}

static jv_t concat_str(loom_jinja_ctx_t *cx, jv_t a, jv_t b) {
    loom_jinja_buf_t buf = {0};
    loom_jinja_buf_put_str(cx, &buf, a.u.s);
    loom_jinja_buf_put_str(cx, &buf, b.u.s);
    return loom_jinja_buf_take(cx, &buf);
}

jv_t loom_jinja_percent_format(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t fmt,
                               jv_t args);

static jv_t binop(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, int op, jv_t a, jv_t b) {
    if (op == JOP_TILDE) {
        a = loom_jinja_to_str(cx, a);
        b = loom_jinja_to_str(cx, b);
        return concat_str(cx, a, b);
    }
    if (isnum(a) && isnum(b)) {
        bool fl = a.t == JV_FLOAT || b.t == JV_FLOAT;
        int64_t x = ival(a), y = ival(b);
        double fx = fval(a), fy = fval(b);
        switch (op) {
        case JOP_ADD:
            if (fl) return loom_jinja_float(fx + fy);
            if ((y > 0 && x > INT64_MAX - y) || (y < 0 && x < INT64_MIN - y)) goto overflow;
            return loom_jinja_int(x + y);
        case JOP_SUB:
            if (fl) return loom_jinja_float(fx - fy);
            if ((y < 0 && x > INT64_MAX + y) || (y > 0 && x < INT64_MIN + y)) goto overflow;
            return loom_jinja_int(x - y);
        case JOP_MUL: {
            if (fl) return loom_jinja_float(fx * fy);
            int64_t r;
            if (__builtin_mul_overflow(x, y, &r)) goto overflow;
            return loom_jinja_int(r);
        }
        case JOP_DIV:
            if (fy == 0) loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "division by zero");
            return loom_jinja_float(fx / fy);
        case JOP_FLOORDIV:
            if (fy == 0)
                loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                "integer division or modulo by zero");
            if (fl) { /* Python's float_floor_div */
                double mod = fmod(fx, fy), div = (fx - mod) / fy, fd;
                if (mod != 0 && ((fy < 0) != (mod < 0))) div -= 1.0;
                if (div != 0) {
                    fd = floor(div);
                    if (div - fd > 0.5) fd += 1.0;
                } else {
                    fd = copysign(0.0, fx / fy);
                }
                return loom_jinja_float(fd);
            }
            if (x == INT64_MIN && y == -1) goto overflow;
            {
                int64_t q = x / y;
                if ((x % y != 0) && ((x < 0) != (y < 0))) q--;
                return loom_jinja_int(q);
            }
        case JOP_MOD:
            if (fy == 0)
                loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                "integer division or modulo by zero");
            if (fl) {
                double m = fmod(fx, fy);
                if (m != 0 && ((m < 0) != (fy < 0))) m += fy;
                if (m == 0) m = copysign(0.0, fy);
                return loom_jinja_float(m);
            }
            if (y == -1) return loom_jinja_int(0);
            {
                int64_t m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) m += y;
                return loom_jinja_int(m);
            }
        case JOP_POW:
            if (fl || y < 0) {
                if (fx == 0 && fy < 0)
                    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "zero to a negative power");
                if (fx < 0 && fy != floor(fy))
                    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                    "a negative number to a fractional power is complex");
                double r = pow(fx, fy);
                if (isinf(r) && isfinite(fx) && isfinite(fy))
                    loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                    "(34, 'Numerical result out of range')");
                return loom_jinja_float(r);
            } else {
                int64_t r = 1;
                for (int64_t k = 0; k < y; k++) {
                    if (__builtin_mul_overflow(r, x, &r)) goto overflow;
                    if (x == 0 || x == 1) break;
                    if (x == -1) {
                        r = (y % 2) ? -1 : 1;
                        break;
                    }
                }
                return loom_jinja_int(r);
            }
        }
    overflow:
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                        "integer overflow (Loom keeps integers in 64 bits)");
    }
    if (op == JOP_ADD && a.t == JV_STR && b.t == JV_STR) return concat_str(cx, a, b);
    if (op == JOP_ADD && a.t == JV_LIST && b.t == JV_LIST) {
        jv_t r = loom_jinja_list_new(cx, a.u.l->n + b.u.l->n);
        r.u.l->tuple = a.u.l->tuple;
        if (a.u.l->tuple != b.u.l->tuple) op_error(cx, at, "+", a, b);
        for (size_t i = 0; i < a.u.l->n; i++)
            r.u.l->v[r.u.l->n++] = a.u.l->v[i];
        for (size_t i = 0; i < b.u.l->n; i++)
            r.u.l->v[r.u.l->n++] = b.u.l->v[i];
        return r;
    }
    if (op == JOP_MUL && ((a.t == JV_STR || a.t == JV_LIST) && (b.t == JV_INT || b.t == JV_BOOL))) {
        jv_t t = a;
        a = b;
        b = t;
    }
    if (op == JOP_MUL && (a.t == JV_INT || a.t == JV_BOOL) && (b.t == JV_STR || b.t == JV_LIST)) {
        int64_t k = ival(a);
        if (k < 0) k = 0;
        if (b.t == JV_STR) {
            if (b.u.s->len && (uint64_t)k > cx->max_output / b.u.s->len)
                loom_jinja_fail(cx, at, LOOM_ERR_RESOURCE_EXHAUSTED,
                                "max_output: the string would exceed %zu bytes", cx->max_output);
            loom_jinja_buf_t buf = {0};
            for (int64_t i = 0; i < k; i++)
                loom_jinja_buf_put(cx, &buf, b.u.s->p, b.u.s->len);
            return loom_jinja_buf_take(cx, &buf);
        }
        if (b.u.l->n && (uint64_t)k * b.u.l->n > cx->max_steps)
            loom_jinja_fail(cx, at, LOOM_ERR_RESOURCE_EXHAUSTED, "max_steps: the list is too long");
        jv_t r = loom_jinja_list_new(cx, (size_t)k * b.u.l->n);
        r.u.l->tuple = b.u.l->tuple;
        for (int64_t i = 0; i < k; i++)
            for (size_t j = 0; j < b.u.l->n; j++)
                r.u.l->v[r.u.l->n++] = b.u.l->v[j];
        cx->steps += (uint64_t)k * b.u.l->n;
        return r;
    }
    if (op == JOP_MOD && a.t == JV_STR) return loom_jinja_percent_format(cx, at, a, b);
    static const char *names[] = {"", "+", "-", "*", "/", "//", "%", "**"};
    op_error(cx, at, op <= JOP_POW ? names[op] : "?", a, b);
}

static bool contains(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t needle, jv_t hay) {
    switch (hay.t) {
    case JV_STR:
        if (needle.t != JV_STR)
            loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                            "'in <string>' requires string as left operand, not %s",
                            loom_jinja_type_name(needle));
        if (!needle.u.s->len) return true;
        if (needle.u.s->len > hay.u.s->len) return false;
        for (size_t i = 0; i + needle.u.s->len <= hay.u.s->len; i++)
            if (memcmp(hay.u.s->p + i, needle.u.s->p, needle.u.s->len) == 0) return true;
        return false;
    case JV_LIST:
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (loom_jinja_eq(hay.u.l->v[i], needle)) return true;
        return false;
    case JV_DICT:
    case JV_NS:
        if ((needle.t == JV_LIST && !needle.u.l->tuple) || needle.t == JV_DICT)
            loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "unhashable type: '%s'",
                            loom_jinja_type_name(needle));
        return loom_jinja_dict_get(hay.u.d, needle) != NULL;
    case JV_UNDEF:
        return false; /* jinja2's Undefined iterates as empty */
    default:
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "argument of type '%s' is not iterable",
                        loom_jinja_type_name(hay));
    }
}

bool loom_jinja_contains(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t needle, jv_t hay);
bool loom_jinja_contains(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t needle, jv_t hay) {
    return contains(cx, at, needle, hay);
}

static bool compare(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, int op, jv_t a, jv_t b) {
    switch (op) {
    case JOP_EQ:
        return loom_jinja_eq(a, b);
    case JOP_NE:
        return !loom_jinja_eq(a, b);
    case JOP_IN:
        return contains(cx, at, a, b);
    case JOP_NOTIN:
        return !contains(cx, at, a, b);
    default:
        break;
    }
    if (a.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, a);
    if (b.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, b);
    int c = loom_jinja_cmp(cx, at, a, b);
    switch (op) {
    case JOP_LT:
        return c < 0;
    case JOP_LE:
        return c <= 0;
    case JOP_GT:
        return c > 0;
    default:
        return c >= 0;
    }
}

/* ---- calls ---- */
static void exec_body(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_nodes_t *body);

static jv_t call_macro(ectx_t *ec, const loom_jinja_node_t *at, loom_jinja_func_t *fn,
                       loom_jinja_args_t *a) {
    loom_jinja_ctx_t *cx = &ec->cx;
    if (++cx->depth > cx->max_depth)
        loom_jinja_fail(cx, at, LOOM_ERR_RESOURCE_EXHAUSTED,
                        "max_depth: macro calls nested deeper than %d", cx->max_depth);
    const loom_jinja_node_t *m = fn->node;
    loom_jinja_scope_t *sc = scope_new(cx, fn->scope);
    int np = m->params.n;
    jv_t varargs = loom_jinja_list_new(cx, 0), kwargs = loom_jinja_dict_new(cx, 0);
    varargs.u.l->tuple = true;
    bool *set = loom_jinja_alloc(cx, (size_t)np + 1);
    memset(set, 0, (size_t)np + 1);
    const char *mname = m->kind == JN_MACRO ? m->name : "caller";
    if (a->n > np && !m->uses_varargs)
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                        "macro '%s' takes not more than %d argument(s)", mname, np);
    for (int i = 0; i < a->n; i++) {
        if (i < np) {
            scope_set(cx, sc, m->params.v[i]->name, m->params.v[i]->name_len, a->v[i]);
            set[i] = true;
        } else {
            loom_jinja_list_push(cx, varargs.u.l, a->v[i]);
        }
    }
    for (int k = 0; k < a->nkw; k++) {
        int i;
        for (i = 0; i < np; i++)
            if (strcmp(m->params.v[i]->name, a->kwn[k]) == 0) break;
        if (i < np) {
            scope_set(cx, sc, m->params.v[i]->name, m->params.v[i]->name_len, a->kwv[k]);
            set[i] = true;
        } else {
            if (!m->uses_kwargs)
                loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT,
                                "macro '%s' takes no keyword argument '%s'", mname, a->kwn[k]);
            loom_jinja_dict_set(cx, kwargs.u.d, loom_jinja_str_c(cx, a->kwn[k]), a->kwv[k]);
        }
    }
    for (int i = 0; i < np; i++)
        if (!set[i]) {
            const loom_jinja_node_t *p = m->params.v[i];
            scope_set(cx, sc, p->name, p->name_len,
                      p->a ? loom_jinja_eval(cx, sc, p->a) : loom_jinja_undef(p->name));
        }
    if (m->kind == JN_MACRO) {
        scope_set(cx, sc, "varargs", 7, varargs);
        scope_set(cx, sc, "kwargs", 6, kwargs);
        if (fn->caller) {
            loom_jinja_func_t *c = loom_jinja_alloc(cx, sizeof *c);
            memset(c, 0, sizeof *c);
            c->kind = JF_CALLER;
            c->node = fn->caller;
            c->scope = fn->caller_scope;
            scope_set(cx, sc, "caller", 6, (jv_t){.t = JV_FUNC, .u.fn = c});
        }
    }
    loom_jinja_buf_t buf = {0}, *saved = cx->out;
    cx->out = &buf;
    int saved_ctl = ec->ctl;
    exec_body(ec, sc, &m->body);
    ec->ctl = saved_ctl;
    cx->out = saved;
    cx->depth--;
    return loom_jinja_buf_take(cx, &buf);
}

jv_t loom_jinja_call_value(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc,
                           const loom_jinja_node_t *at, jv_t fn, jv_t *args, int nargs,
                           const char **kwn, jv_t *kwv, int nkw) {
    (void)sc;
    ectx_t *ec = (ectx_t *)cx;
    loom_jinja_args_t a = {args, nargs, kwn, kwv, nkw};
    if (fn.t == JV_UNDEF) loom_jinja_undefined_error(cx, at, fn);
    if (fn.t != JV_FUNC)
        loom_jinja_fail(cx, at, LOOM_ERR_INVALID_ARGUMENT, "'%s' object is not callable",
                        loom_jinja_type_name(fn));
    switch (fn.u.fn->kind) {
    case JF_MACRO:
    case JF_CALLER:
        return call_macro(ec, at, fn.u.fn, &a);
    case JF_METHOD:
        return loom_jinja_call_method(cx, at, fn.u.fn, &a);
    default:
        return loom_jinja_call_global(cx, at, fn.u.fn, &a);
    }
}

static void eval_args(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *n,
                      loom_jinja_args_t *a, int extra_front) {
    a->n = n->args.n + extra_front;
    a->v = loom_jinja_alloc(cx, (size_t)(a->n + 1) * sizeof *a->v);
    for (int i = 0; i < n->args.n; i++)
        a->v[extra_front + i] = loom_jinja_eval(cx, sc, n->args.v[i]);
    a->nkw = n->kwargs.n;
    a->kwn = loom_jinja_alloc(cx, (size_t)(a->nkw + 1) * sizeof *a->kwn);
    a->kwv = loom_jinja_alloc(cx, (size_t)(a->nkw + 1) * sizeof *a->kwv);
    for (int i = 0; i < n->kwargs.n; i++) {
        a->kwn[i] = n->kwargs.v[i]->name;
        a->kwv[i] = loom_jinja_eval(cx, sc, n->kwargs.v[i]->a);
    }
}

static jv_t apply_filter_chain(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_node_t *f,
                               jv_t v) {
    if (!f) return v;
    v = apply_filter_chain(ec, sc, f->a, v);
    loom_jinja_args_t a;
    eval_args(&ec->cx, sc, f, &a, 0);
    return loom_jinja_filter(&ec->cx, sc, f, f->name, v, &a);
}

/* ---- expressions ---- */

/* Whether jinja2 would fold N to a constant at compile time (literals and operators over them). */
static bool is_const_expr(const loom_jinja_node_t *n) {
    switch (n->kind) {
    case JN_CONST:
        return true;
    case JN_UNOP:
        return is_const_expr(n->a);
    case JN_BINOP:
    case JN_COMPARE:
        return is_const_expr(n->a) && is_const_expr(n->b);
    case JN_CONDEXPR:
        return is_const_expr(n->a) && is_const_expr(n->b) && (!n->c3 || is_const_expr(n->c3));
    default:
        return false;
    }
}

/* jinja2 folds -3 to a constant and writes `-3 ** x` into Python, which
 * reads it as -(3 ** x) when x is not constant; Loom gives the same. */
static bool neg_literal_pow(const loom_jinja_node_t *n) {
    return n->op == JOP_POW && n->a->kind == JN_UNOP && n->a->op == JOP_NEG &&
           n->a->a->kind == JN_CONST &&
           (n->a->a->c.type == JV_INT || n->a->a->c.type == JV_FLOAT) && !is_const_expr(n->b);
}
jv_t loom_jinja_eval(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *n) {
    ectx_t *ec = (ectx_t *)cx;
    loom_jinja_step(cx, n);
    switch (n->kind) {
    case JN_CONST:
        switch (n->c.type) {
        case JV_NONE:
            return loom_jinja_none();
        case JV_BOOL:
            return loom_jinja_bool(n->c.i != 0);
        case JV_INT:
            return loom_jinja_int(n->c.i);
        case JV_FLOAT:
            return loom_jinja_float(n->c.f);
        default:
            return loom_jinja_str(cx, n->c.s, n->c.len, false);
        }
    case JN_NAME:
        return lookup(ec, sc, n);
    case JN_LIST:
    case JN_TUPLE: {
        jv_t l = loom_jinja_list_new(cx, (size_t)n->args.n);
        l.u.l->tuple = n->kind == JN_TUPLE;
        for (int i = 0; i < n->args.n; i++)
            l.u.l->v[l.u.l->n++] = loom_jinja_eval(cx, sc, n->args.v[i]);
        return l;
    }
    case JN_DICT: {
        jv_t d = loom_jinja_dict_new(cx, (size_t)n->args.n / 2);
        for (int i = 0; i + 1 < n->args.n; i += 2) {
            jv_t k = loom_jinja_eval(cx, sc, n->args.v[i]);
            if (k.t == JV_LIST && !k.u.l->tuple)
                loom_jinja_fail(cx, n->args.v[i], LOOM_ERR_INVALID_ARGUMENT,
                                "unhashable type: 'list'");
            if (k.t == JV_DICT)
                loom_jinja_fail(cx, n->args.v[i], LOOM_ERR_INVALID_ARGUMENT,
                                "unhashable type: 'dict'");
            loom_jinja_dict_set(cx, d.u.d, k, loom_jinja_eval(cx, sc, n->args.v[i + 1]));
        }
        return d;
    }
    case JN_GETATTR:
        return loom_jinja_getattr(cx, n, loom_jinja_eval(cx, sc, n->a), n->name, n->name_len);
    case JN_GETITEM: {
        jv_t o = loom_jinja_eval(cx, sc, n->a);
        return loom_jinja_getitem(cx, n, o, loom_jinja_eval(cx, sc, n->b));
    }
    case JN_SLICE: {
        jv_t o = loom_jinja_eval(cx, sc, n->a);
        jv_t none = loom_jinja_none();
        jv_t lo = n->b ? loom_jinja_eval(cx, sc, n->b) : none;
        jv_t hi = n->c3 ? loom_jinja_eval(cx, sc, n->c3) : none;
        jv_t st = n->iter ? loom_jinja_eval(cx, sc, n->iter) : none;
        return do_slice(cx, n, o, lo, hi, st);
    }
    case JN_CALL: {
        jv_t fn = loom_jinja_eval(cx, sc, n->a);
        if (fn.t == JV_UNDEF) loom_jinja_undefined_error(cx, n->a, fn);
        loom_jinja_args_t a;
        eval_args(cx, sc, n, &a, 0);
        return loom_jinja_call_value(cx, sc, n, fn, a.v, a.n, a.kwn, a.kwv, a.nkw);
    }
    case JN_FILTER: {
        jv_t v = loom_jinja_eval(cx, sc, n->a);
        loom_jinja_args_t a;
        eval_args(cx, sc, n, &a, 0);
        return loom_jinja_filter(cx, sc, n, n->name, v, &a);
    }
    case JN_TEST: {
        jv_t v = loom_jinja_eval(cx, sc, n->a);
        loom_jinja_args_t a;
        eval_args(cx, sc, n, &a, 0);
        bool r = loom_jinja_test(cx, sc, n, n->name, v, &a);
        return loom_jinja_bool(n->negate ? !r : r);
    }
    case JN_BINOP:
        if (n->op == JOP_AND) {
            jv_t a = loom_jinja_eval(cx, sc, n->a);
            return loom_jinja_truthy(a) ? loom_jinja_eval(cx, sc, n->b) : a;
        }
        if (n->op == JOP_OR) {
            jv_t a = loom_jinja_eval(cx, sc, n->a);
            return loom_jinja_truthy(a) ? a : loom_jinja_eval(cx, sc, n->b);
        } else {
            if (neg_literal_pow(n)) {
                jv_t a = loom_jinja_eval(cx, sc, n->a->a);
                jv_t b = loom_jinja_eval(cx, sc, n->b);
                jv_t r = binop(cx, n, n->op, a, b);
                if (r.t == JV_INT) return loom_jinja_int(-r.u.i);
                return loom_jinja_float(-r.u.f);
            }
            jv_t a = loom_jinja_eval(cx, sc, n->a);
            jv_t b = loom_jinja_eval(cx, sc, n->b);
            return binop(cx, n, n->op, a, b);
        }
    case JN_UNOP: {
        jv_t a = loom_jinja_eval(cx, sc, n->a);
        if (n->op == JOP_NOT) return loom_jinja_bool(!loom_jinja_truthy(a));
        if (a.t == JV_INT || a.t == JV_BOOL) {
            int64_t i = ival(a);
            if (n->op == JOP_NEG && i == INT64_MIN)
                loom_jinja_fail(cx, n, LOOM_ERR_INVALID_ARGUMENT, "integer overflow");
            return loom_jinja_int(n->op == JOP_NEG ? -i : i);
        }
        if (a.t == JV_FLOAT) return loom_jinja_float(n->op == JOP_NEG ? -a.u.f : a.u.f);
        if (a.t == JV_UNDEF) loom_jinja_undefined_error(cx, n, a);
        loom_jinja_fail(cx, n, LOOM_ERR_INVALID_ARGUMENT, "bad operand type for unary %c: '%s'",
                        n->op == JOP_NEG ? '-' : '+', loom_jinja_type_name(a));
    }
    case JN_COMPARE: {
        jv_t a = loom_jinja_eval(cx, sc, n->a);
        jv_t b = loom_jinja_eval(cx, sc, n->b);
        return loom_jinja_bool(compare(cx, n, n->op, a, b));
    }
    case JN_CONDEXPR:
        if (loom_jinja_truthy(loom_jinja_eval(cx, sc, n->a))) return loom_jinja_eval(cx, sc, n->b);
        return n->c3 ? loom_jinja_eval(cx, sc, n->c3) : loom_jinja_undef(NULL);
    default:
        loom_jinja_fail(cx, n, LOOM_ERR_INTERNAL, "not an expression");
    }
}

/* ---- statements ---- */
static void assign(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_node_t *target, jv_t v) {
    loom_jinja_ctx_t *cx = &ec->cx;
    if (target->kind == JN_NAME) {
        scope_set(cx, sc, target->name, target->name_len, v);
    } else if (target->kind == JN_NSREF) {
        jv_t ns = lookup(ec, sc, target->a);
        if (ns.t != JV_NS)
            loom_jinja_fail(cx, target, LOOM_ERR_INVALID_ARGUMENT,
                            "can only set attributes of a namespace, not of '%s'", target->a->name);
        loom_jinja_dict_set(cx, ns.u.d, loom_jinja_str(cx, target->name, target->name_len, false),
                            v);
    } else { /* tuple unpacking */
        if (v.t != JV_LIST && v.t != JV_STR && v.t != JV_DICT)
            loom_jinja_fail(cx, target, LOOM_ERR_INVALID_ARGUMENT,
                            "cannot unpack non-iterable %s object", loom_jinja_type_name(v));
        loom_jinja_list_t *l = loom_jinja_iterate(cx, target, v);
        if ((int)l->n != target->args.n)
            loom_jinja_fail(
                cx, target, LOOM_ERR_INVALID_ARGUMENT, "%s values to unpack (expected %d, got %zu)",
                (int)l->n > target->args.n ? "too many" : "not enough", target->args.n, l->n);
        for (int i = 0; i < target->args.n; i++)
            assign(ec, sc, target->args.v[i], l->v[i]);
    }
}

static void exec_for(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_node_t *n) {
    loom_jinja_ctx_t *cx = &ec->cx;
    jv_t it = loom_jinja_eval(cx, sc, n->iter);
    loom_jinja_list_t *items = loom_jinja_iterate(cx, n->iter, it);
    if (n->cond) {
        jv_t f = loom_jinja_list_new(cx, items->n);
        loom_jinja_scope_t *s = NULL;
        for (size_t i = 0; i < items->n; i++) {
            loom_jinja_step(cx, n);
            if (!s || s->captured) s = scope_new(cx, sc);
            s->n = 0;
            assign(ec, s, n->target, items->v[i]);
            if (loom_jinja_truthy(loom_jinja_eval(cx, s, n->cond)))
                f.u.l->v[f.u.l->n++] = items->v[i];
        }
        items = f.u.l;
    }
    loom_jinja_loop_t *lp = loom_jinja_alloc(cx, sizeof *lp);
    memset(lp, 0, sizeof *lp);
    lp->length = (int64_t)items->n;
    jv_t loopv = {.t = JV_LOOP, .u.loop = lp};
    loom_jinja_scope_t *s = NULL; /* each iteration starts afresh; reused unless a macro holds it */
    bool completed = false;
    for (size_t i = 0; i < items->n; i++) {
        loom_jinja_step(cx, n);
        lp->index0 = (int64_t)i;
        lp->has_prev = i > 0;
        if (i > 0) lp->prev = items->v[i - 1];
        lp->has_next = i + 1 < items->n;
        if (i + 1 < items->n) lp->next = items->v[i + 1];
        if (!s || s->captured) s = scope_new(cx, sc);
        s->n = 0;
        scope_set(cx, s, "loop", 4, loopv);
        assign(ec, s, n->target, items->v[i]);
        exec_body(ec, s, &n->body);
        if (ec->ctl == CTL_NONE) completed = true;
        if (ec->ctl == CTL_BREAK) {
            ec->ctl = CTL_NONE;
            break;
        }
        ec->ctl = CTL_NONE;
    }
    /* jinja2 runs `else` when no iteration ran to its end: an empty loop, or
     * one whose every iteration left through break or continue */
    if (!completed) exec_body(ec, scope_new(cx, sc), &n->else_body);
}

static void exec_node(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_node_t *n) {
    loom_jinja_ctx_t *cx = &ec->cx;
    switch (n->kind) {
    case JN_TEXT:
        loom_jinja_step(cx, n);
        loom_jinja_buf_put(cx, cx->out, n->c.s, n->c.len);
        return;
    case JN_OUTPUT: {
        jv_t v = loom_jinja_eval(cx, sc, n->a);
        loom_jinja_write_str(cx, cx->out, v);
        return;
    }
    case JN_IF:
        loom_jinja_step(cx, n);
        if (loom_jinja_truthy(loom_jinja_eval(cx, sc, n->a)))
            exec_body(ec, sc, &n->body);
        else
            exec_body(ec, sc, &n->else_body);
        return;
    case JN_FOR:
        exec_for(ec, sc, n);
        return;
    case JN_SET:
        assign(ec, sc, n->target, loom_jinja_eval(cx, sc, n->iter));
        return;
    case JN_SET_BLOCK:
    case JN_FILTER_BLOCK: {
        /* the body renders in a scope of its own, as jinja2's inner frame */
        loom_jinja_buf_t buf = {0}, *saved = cx->out;
        cx->out = &buf;
        exec_body(ec, scope_new(cx, sc), &n->body);
        cx->out = saved;
        jv_t v = apply_filter_chain(ec, sc, n->iter, loom_jinja_buf_take(cx, &buf));
        if (n->kind == JN_SET_BLOCK)
            assign(ec, sc, n->target, v);
        else
            loom_jinja_write_str(cx, cx->out, v);
        return;
    }
    case JN_MACRO: {
        loom_jinja_func_t *f = loom_jinja_alloc(cx, sizeof *f);
        memset(f, 0, sizeof *f);
        f->kind = JF_MACRO;
        f->node = n;
        f->scope = sc;
        sc->captured = true;
        scope_set(cx, sc, n->name, n->name_len, (jv_t){.t = JV_FUNC, .u.fn = f});
        return;
    }
    case JN_CALL_BLOCK: {
        const loom_jinja_node_t *call = n->iter;
        jv_t fn = loom_jinja_eval(cx, sc, call->a);
        if (fn.t != JV_FUNC || fn.u.fn->kind != JF_MACRO)
            loom_jinja_fail(cx, call, LOOM_ERR_INVALID_ARGUMENT, "a call block needs a macro");
        loom_jinja_func_t *f = loom_jinja_alloc(cx, sizeof *f);
        *f = *fn.u.fn;
        f->caller = n;
        f->caller_scope = sc;
        sc->captured = true;
        loom_jinja_args_t a;
        eval_args(cx, sc, call, &a, 0);
        jv_t r = call_macro(ec, call, f, &a);
        loom_jinja_write_str(cx, cx->out, r);
        return;
    }
    case JN_BREAK:
        ec->ctl = CTL_BREAK;
        return;
    case JN_CONTINUE:
        ec->ctl = CTL_CONTINUE;
        return;
    case JN_BODY:
        exec_body(ec, sc, &n->body);
        return;
    default:
        loom_jinja_fail(cx, n, LOOM_ERR_INTERNAL, "not a statement");
    }
}

static void exec_body(ectx_t *ec, loom_jinja_scope_t *sc, const loom_jinja_nodes_t *body) {
    for (int i = 0; i < body->n && ec->ctl == CTL_NONE; i++)
        exec_node(ec, sc, body->v[i]);
}

/* ---- entry ---- */
static loom_status_t render(const loom_jinja_t *t, const cJSON *vars,
                            const loom_jinja_limits_t *lim, char **out, size_t *out_len,
                            loom_jinja_span_t **spans, size_t *n_spans, loom_err_t *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (spans) *spans = NULL;
    if (n_spans) *n_spans = 0;
    if (!t) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "no template");
    if (vars && !cJSON_IsObject(vars))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: vars must be a JSON object",
                            t->name);
    ectx_t *ec = calloc(1, sizeof *ec);
    if (!ec) return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory");
    loom_jinja_ctx_t *cx = &ec->cx;
    cx->t = t;
    cx->err = err;
    cx->max_output = lim && lim->max_output ? lim->max_output : (size_t)1 << 20;
    cx->max_steps = lim && lim->max_steps ? lim->max_steps : 10000000;
    cx->max_depth = lim && lim->max_depth ? lim->max_depth : 64;
    cx->track_spans = spans != NULL;
    size_t limit = (size_t)256 << 20;
    if (cx->max_output > ((size_t)1 << 58)) cx->max_output = (size_t)1 << 58;
    if (cx->max_output * 16 > limit) limit = cx->max_output * 16;
    cx->arena.limit = limit;
    ec->root.vars = vars;
    loom_jinja_buf_t outb = {0};
    loom_status_t s = LOOM_OK;
    if (setjmp(cx->jb) == 0) {
        cx->out = &outb;
        loom_jinja_scope_t *sc = scope_new(cx, NULL);
        exec_body(ec, sc, &t->body);
        char *r = malloc(outb.len + 1);
        loom_jinja_span_t *sp = spans && outb.nsp ? malloc(outb.nsp * sizeof *sp) : NULL;
        if (!r || (spans && outb.nsp && !sp)) {
            free(r);
            free(sp);
            s = loom_err_set(err, LOOM_ERR_NOMEM, "out of memory");
        } else {
            if (outb.len) memcpy(r, outb.p, outb.len);
            r[outb.len] = '\0';
            *out = r;
            if (out_len) *out_len = outb.len;
            if (sp) memcpy(sp, outb.sp, outb.nsp * sizeof *sp);
            if (spans) *spans = sp;
            if (n_spans) *n_spans = sp ? outb.nsp : 0;
        }
    } else {
        s = cx->status;
    }
    loom_jinja_arena_free(&cx->arena);
    free(ec);
    return s;
}

loom_status_t loom_jinja_render(const loom_jinja_t *t, const cJSON *vars,
                                const loom_jinja_limits_t *lim, char **out, size_t *out_len,
                                loom_err_t *err) {
    return render(t, vars, lim, out, out_len, NULL, NULL, err);
}

loom_status_t loom_jinja_render_spans(const loom_jinja_t *t, const cJSON *vars,
                                      const loom_jinja_limits_t *lim, char **out, size_t *out_len,
                                      loom_jinja_span_t **spans, size_t *n_spans, loom_err_t *err) {
    return render(t, vars, lim, out, out_len, spans, n_spans, err);
}

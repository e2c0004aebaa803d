/* Jinja parser: tokens to a syntax tree, with jinja2's operator precedence
 * (conditional < or < and < not < compare < + - < ~ < * / // % < ** < unary
 * < filters/tests/calls < postfix). Also owns compile/destroy. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jinja_impl.h"

typedef struct {
    loom_jinja_lex_t *lx;
    loom_jinja_tok_t *tk;
    size_t i;
    loom_jinja_pool_t *pool;
    loom_err_t *err;
    int depth;
} parser_t;

struct loom_jinja_pool_blk {
    struct loom_jinja_pool_blk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};

void *loom_jinja_pool_alloc(loom_jinja_pool_t *p, size_t n) {
    n = (n + 15) & ~(size_t)15;
    struct loom_jinja_pool_blk *b = p->head;
    if (!b || b->used + n > b->cap) {
        size_t cap = n > 16384 ? n : 16384;
        b = malloc(sizeof *b + cap);
        if (!b) return NULL;
        b->next = p->head;
        b->used = 0;
        b->cap = cap;
        p->head = b;
    }
    void *r = b->data + b->used;
    b->used += n;
    memset(r, 0, n);
    return r;
}

void loom_jinja_pool_free(loom_jinja_pool_t *p) {
    while (p->head) {
        struct loom_jinja_pool_blk *n = p->head->next;
        free(p->head);
        p->head = n;
    }
}

#define PCHECK(x)                                                                                  \
    do {                                                                                           \
        if (!(x)) return NULL;                                                                     \
    } while (0)

static void *perr(parser_t *ps, const loom_jinja_tok_t *t, const char *fmt, ...) {
    if (ps->err && ps->err->code < 0) return NULL; /* keep the first */
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    loom_err_set(ps->err, LOOM_ERR_INVALID_ARGUMENT, "%s:%d:%d: %s", ps->lx->name, t->line, t->col,
                 what);
    return NULL;
}

static loom_jinja_tok_t *cur(parser_t *ps) {
    return &ps->tk[ps->i];
}
static loom_jinja_tok_t *peek(parser_t *ps, size_t k) {
    size_t j = ps->i + k;
    return j < ps->lx->ntoks ? &ps->tk[j] : &ps->tk[ps->lx->ntoks - 1];
}
static void next(parser_t *ps) {
    if (ps->tk[ps->i].kind != JT_EOF) ps->i++;
}
static bool is_op(parser_t *ps, int op) {
    return cur(ps)->kind == JT_OP && cur(ps)->op == op;
}
static bool is_name(const loom_jinja_tok_t *t, const char *s) {
    return t->kind == JT_NAME && t->len == strlen(s) && memcmp(t->s, s, t->len) == 0;
}
static bool accept_op(parser_t *ps, int op) {
    if (is_op(ps, op)) {
        next(ps);
        return true;
    }
    return false;
}
static const char *tok_desc(const loom_jinja_tok_t *t, char *buf, size_t n) {
    switch (t->kind) {
    case JT_EOF:
        return "end of template";
    case JT_TEXT:
        return "template data";
    case JT_VAR_BEGIN:
        return "'{{'";
    case JT_VAR_END:
        return "'}}'";
    case JT_BLOCK_BEGIN:
        return "'{%'";
    case JT_BLOCK_END:
        return "'%}'";
    case JT_STRING:
        return "string";
    case JT_INT:
    case JT_FLOAT:
        return "number";
    default:
        snprintf(buf, n, "'%.*s'", (int)(t->len > 40 ? 40 : t->len), t->s);
        return buf;
    }
}
static bool expect_op(parser_t *ps, int op, const char *what) {
    if (accept_op(ps, op)) return true;
    char b[64];
    perr(ps, cur(ps), "expected '%s', got %s", what, tok_desc(cur(ps), b, sizeof b));
    return false;
}

static loom_jinja_node_t *mk(parser_t *ps, loom_jinja_node_kind_t k, const loom_jinja_tok_t *at) {
    loom_jinja_node_t *n = loom_jinja_pool_alloc(ps->pool, sizeof *n);
    if (!n) return perr(ps, at, "out of memory");
    n->kind = k;
    n->line = at->line;
    n->col = at->col;
    return n;
}

static bool nodes_push(parser_t *ps, loom_jinja_nodes_t *l, loom_jinja_node_t *n) {
    if ((l->n & (l->n - 1)) == 0) { /* grow at powers of two */
        int cap = l->n ? l->n * 2 : 1;
        loom_jinja_node_t **v = loom_jinja_pool_alloc(ps->pool, (size_t)cap * sizeof *v);
        if (!v) return false;
        if (l->n) memcpy(v, l->v, (size_t)l->n * sizeof *v);
        l->v = v;
    }
    l->v[l->n++] = n;
    return true;
}

static const char *dupname(parser_t *ps, const loom_jinja_tok_t *t) {
    char *s = loom_jinja_pool_alloc(ps->pool, t->len + 1);
    if (s) memcpy(s, t->s, t->len);
    return s;
}

static loom_jinja_node_t *parse_expr(parser_t *ps);
static loom_jinja_node_t *parse_or(parser_t *ps);
static loom_jinja_node_t *parse_unary(parser_t *ps, bool with_filter);
static loom_jinja_node_t *parse_primary(parser_t *ps);
static loom_jinja_node_t *parse_postfix(parser_t *ps, loom_jinja_node_t *n);

/* (args) for calls, filters and tests: positional then name=value. */
static bool parse_call_args(parser_t *ps, loom_jinja_node_t *n) {
    if (!expect_op(ps, JOP_LPAREN, "(")) return false;
    while (!is_op(ps, JOP_RPAREN)) {
        if (n->args.n + n->kwargs.n > 0 && !expect_op(ps, JOP_COMMA, ",")) return false;
        if (is_op(ps, JOP_RPAREN)) break;
        loom_jinja_tok_t *t = cur(ps);
        if (t->kind == JT_NAME && peek(ps, 1)->kind == JT_OP && peek(ps, 1)->op == JOP_ASSIGN) {
            loom_jinja_node_t *kw = mk(ps, JN_CONST, t);
            if (!kw) return false;
            kw->name = dupname(ps, t);
            kw->name_len = t->len;
            next(ps);
            next(ps);
            if (!(kw->a = parse_expr(ps))) return false;
            if (!nodes_push(ps, &n->kwargs, kw)) return false;
        } else {
            if (n->kwargs.n) {
                perr(ps, t, "positional argument after keyword argument");
                return false;
            }
            loom_jinja_node_t *a = parse_expr(ps);
            if (!a || !nodes_push(ps, &n->args, a)) return false;
        }
    }
    next(ps);
    return true;
}

static loom_jinja_node_t *parse_filter(parser_t *ps, loom_jinja_node_t *n) {
    /* at '|' */
    next(ps);
    loom_jinja_tok_t *t = cur(ps);
    if (t->kind != JT_NAME) return perr(ps, t, "expected a filter name");
    loom_jinja_node_t *f = mk(ps, JN_FILTER, t);
    PCHECK(f);
    /* dotted filter names are not a thing in chat templates */
    f->name = dupname(ps, t);
    f->name_len = t->len;
    if (!loom_jinja_has_filter(f->name)) return perr(ps, t, "no filter named '%s'", f->name);
    next(ps);
    f->a = n;
    if (is_op(ps, JOP_LPAREN) && !parse_call_args(ps, f)) return NULL;
    return f;
}

static loom_jinja_node_t *parse_test(parser_t *ps, loom_jinja_node_t *n) {
    /* at 'is' */
    next(ps);
    bool neg = false;
    if (is_name(cur(ps), "not")) {
        neg = true;
        next(ps);
    }
    loom_jinja_tok_t *t = cur(ps);
    if (t->kind != JT_NAME) return perr(ps, t, "expected a test name");
    loom_jinja_node_t *f = mk(ps, JN_TEST, t);
    PCHECK(f);
    f->name = dupname(ps, t);
    f->name_len = t->len;
    if (!loom_jinja_has_test(f->name)) return perr(ps, t, "no test named '%s'", f->name);
    f->negate = neg;
    f->a = n;
    next(ps);
    loom_jinja_tok_t *c = cur(ps);
    if (is_op(ps, JOP_LPAREN)) {
        if (!parse_call_args(ps, f)) return NULL;
    } else if ((c->kind == JT_NAME && !is_name(c, "else") && !is_name(c, "or") &&
                !is_name(c, "and") && !is_name(c, "is") && !is_name(c, "in") &&
                !is_name(c, "not") && !is_name(c, "if")) ||
               c->kind == JT_STRING || c->kind == JT_INT || c->kind == JT_FLOAT ||
               (c->kind == JT_OP && (c->op == JOP_LBRACKET || c->op == JOP_LBRACE))) {
        loom_jinja_node_t *arg = parse_primary(ps);
        PCHECK(arg);
        arg = parse_postfix(ps, arg);
        PCHECK(arg);
        if (!nodes_push(ps, &f->args, arg)) return NULL;
    }
    return f;
}

static loom_jinja_node_t *parse_filter_expr(parser_t *ps, loom_jinja_node_t *n) {
    for (;;) {
        if (is_op(ps, JOP_PIPE)) {
            n = parse_filter(ps, n);
        } else if (is_name(cur(ps), "is")) {
            n = parse_test(ps, n);
        } else if (is_op(ps, JOP_LPAREN)) {
            loom_jinja_node_t *c = mk(ps, JN_CALL, cur(ps));
            PCHECK(c);
            c->a = n;
            if (!parse_call_args(ps, c)) return NULL;
            n = c;
        } else {
            return n;
        }
        PCHECK(n);
    }
}

static loom_jinja_node_t *parse_subscript(parser_t *ps, loom_jinja_node_t *obj) {
    loom_jinja_tok_t *t = cur(ps); /* at '[' */
    next(ps);
    loom_jinja_node_t *lo = NULL, *hi = NULL, *st = NULL;
    bool slice = false;
    if (!is_op(ps, JOP_COLON)) PCHECK(lo = parse_expr(ps));
    if (accept_op(ps, JOP_COLON)) {
        slice = true;
        if (!is_op(ps, JOP_RBRACKET) && !is_op(ps, JOP_COLON)) PCHECK(hi = parse_expr(ps));
        if (accept_op(ps, JOP_COLON))
            if (!is_op(ps, JOP_RBRACKET)) PCHECK(st = parse_expr(ps));
    }
    if (!expect_op(ps, JOP_RBRACKET, "]")) return NULL;
    loom_jinja_node_t *n = mk(ps, slice ? JN_SLICE : JN_GETITEM, t);
    PCHECK(n);
    n->a = obj;
    if (slice) {
        n->b = lo;
        n->c3 = hi;
        n->iter = st;
    } else {
        n->b = lo;
    }
    return n;
}

static loom_jinja_node_t *parse_postfix(parser_t *ps, loom_jinja_node_t *n) {
    for (;;) {
        loom_jinja_tok_t *t = cur(ps);
        if (is_op(ps, JOP_DOT)) {
            next(ps);
            loom_jinja_tok_t *a = cur(ps);
            if (a->kind == JT_NAME) {
                loom_jinja_node_t *g = mk(ps, JN_GETATTR, t);
                PCHECK(g);
                g->a = n;
                g->name = dupname(ps, a);
                g->name_len = a->len;
                next(ps);
                n = g;
            } else if (a->kind == JT_INT) {
                loom_jinja_node_t *g = mk(ps, JN_GETITEM, t), *k = mk(ps, JN_CONST, a);
                PCHECK(g && k);
                k->c.type = JV_INT;
                k->c.i = a->i;
                g->a = n;
                g->b = k;
                next(ps);
                n = g;
            } else {
                return perr(ps, a, "expected an attribute name after '.'");
            }
        } else if (is_op(ps, JOP_LBRACKET)) {
            PCHECK(n = parse_subscript(ps, n));
        } else if (is_op(ps, JOP_LPAREN)) {
            loom_jinja_node_t *c = mk(ps, JN_CALL, t);
            PCHECK(c);
            c->a = n;
            if (!parse_call_args(ps, c)) return NULL;
            n = c;
        } else {
            return n;
        }
    }
}

static loom_jinja_node_t *parse_primary(parser_t *ps) {
    loom_jinja_tok_t *t = cur(ps);
    if (++ps->depth > 200) return perr(ps, t, "expression nested too deeply");
    loom_jinja_node_t *n = NULL;
    char b[64];
    switch (t->kind) {
    case JT_NAME:
        n = mk(ps, JN_CONST, t);
        PCHECK(n);
        if (is_name(t, "true") || is_name(t, "True") || is_name(t, "false") ||
            is_name(t, "False")) {
            n->c.type = JV_BOOL;
            n->c.i = t->s[0] == 't' || t->s[0] == 'T';
        } else if (is_name(t, "none") || is_name(t, "None")) {
            n->c.type = JV_NONE;
        } else {
            n->kind = JN_NAME;
            n->name = dupname(ps, t);
            n->name_len = t->len;
        }
        next(ps);
        break;
    case JT_STRING: {
        n = mk(ps, JN_CONST, t);
        PCHECK(n);
        n->c.type = JV_STR;
        n->c.s = t->s;
        n->c.len = t->len;
        next(ps);
        if (cur(ps)->kind == JT_STRING) { /* adjacent literals concatenate */
            size_t total = n->c.len;
            for (size_t k = ps->i; ps->tk[k].kind == JT_STRING; k++)
                total += ps->tk[k].len;
            char *s = loom_jinja_pool_alloc(ps->pool, total + 1);
            PCHECK(s);
            memcpy(s, n->c.s, n->c.len);
            size_t at = n->c.len;
            while (cur(ps)->kind == JT_STRING) {
                memcpy(s + at, cur(ps)->s, cur(ps)->len);
                at += cur(ps)->len;
                next(ps);
            }
            n->c.s = s;
            n->c.len = total;
        }
        break;
    }
    case JT_INT:
    case JT_FLOAT:
        n = mk(ps, JN_CONST, t);
        PCHECK(n);
        n->c.type = t->kind == JT_INT ? JV_INT : JV_FLOAT;
        n->c.i = t->i;
        n->c.f = t->f;
        next(ps);
        break;
    case JT_OP:
        if (t->op == JOP_LPAREN) {
            next(ps);
            if (accept_op(ps, JOP_RPAREN)) {
                PCHECK(n = mk(ps, JN_TUPLE, t));
                break;
            }
            loom_jinja_node_t *e = parse_expr(ps);
            PCHECK(e);
            if (is_op(ps, JOP_COMMA)) {
                PCHECK(n = mk(ps, JN_TUPLE, t));
                if (!nodes_push(ps, &n->args, e)) return NULL;
                while (accept_op(ps, JOP_COMMA)) {
                    if (is_op(ps, JOP_RPAREN)) break;
                    PCHECK(e = parse_expr(ps));
                    if (!nodes_push(ps, &n->args, e)) return NULL;
                }
            } else {
                n = e;
            }
            if (!expect_op(ps, JOP_RPAREN, ")")) return NULL;
        } else if (t->op == JOP_LBRACKET) {
            next(ps);
            PCHECK(n = mk(ps, JN_LIST, t));
            while (!is_op(ps, JOP_RBRACKET)) {
                if (n->args.n && !expect_op(ps, JOP_COMMA, ",")) return NULL;
                if (is_op(ps, JOP_RBRACKET)) break;
                loom_jinja_node_t *e = parse_expr(ps);
                if (!e || !nodes_push(ps, &n->args, e)) return NULL;
            }
            next(ps);
        } else if (t->op == JOP_LBRACE) {
            next(ps);
            PCHECK(n = mk(ps, JN_DICT, t));
            while (!is_op(ps, JOP_RBRACE)) {
                if (n->args.n && !expect_op(ps, JOP_COMMA, ",")) return NULL;
                if (is_op(ps, JOP_RBRACE)) break;
                loom_jinja_node_t *k = parse_expr(ps);
                PCHECK(k);
                if (!expect_op(ps, JOP_COLON, ":")) return NULL;
                loom_jinja_node_t *v = parse_expr(ps);
                if (!v || !nodes_push(ps, &n->args, k) || !nodes_push(ps, &n->args, v)) return NULL;
            }
            next(ps);
        } else {
            return perr(ps, t, "unexpected %s", tok_desc(t, b, sizeof b));
        }
        break;
    default:
        return perr(ps, t, "unexpected %s", tok_desc(t, b, sizeof b));
    }
    ps->depth--;
    return n;
}

static loom_jinja_node_t *binop(parser_t *ps, const loom_jinja_tok_t *t, int op,
                                loom_jinja_node_t *a, loom_jinja_node_t *b) {
    loom_jinja_node_t *n = mk(ps, JN_BINOP, t);
    PCHECK(n);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static loom_jinja_node_t *parse_unary(parser_t *ps, bool with_filter) {
    loom_jinja_tok_t *t = cur(ps);
    loom_jinja_node_t *n;
    if (++ps->depth > 200) return perr(ps, t, "expression nested too deeply");
    if (is_op(ps, JOP_SUB) || is_op(ps, JOP_ADD)) {
        next(ps);
        PCHECK(n = mk(ps, JN_UNOP, t));
        n->op = t->op == JOP_SUB ? JOP_NEG : JOP_POS;
        PCHECK(n->a = parse_unary(ps, false));
    } else {
        PCHECK(n = parse_primary(ps));
    }
    PCHECK(n = parse_postfix(ps, n));
    if (with_filter) PCHECK(n = parse_filter_expr(ps, n));
    ps->depth--;
    return n;
}

static loom_jinja_node_t *parse_pow(parser_t *ps) {
    loom_jinja_node_t *n = parse_unary(ps, true);
    while (n && is_op(ps, JOP_POW)) {
        loom_jinja_tok_t *t = cur(ps);
        next(ps);
        loom_jinja_node_t *r = parse_unary(ps, true);
        PCHECK(r);
        n = binop(ps, t, JOP_POW, n, r);
    }
    return n;
}

static loom_jinja_node_t *parse_math2(parser_t *ps) {
    loom_jinja_node_t *n = parse_pow(ps);
    while (n && (is_op(ps, JOP_MUL) || is_op(ps, JOP_DIV) || is_op(ps, JOP_FLOORDIV) ||
                 is_op(ps, JOP_MOD))) {
        loom_jinja_tok_t *t = cur(ps);
        next(ps);
        loom_jinja_node_t *r = parse_pow(ps);
        PCHECK(r);
        n = binop(ps, t, t->op, n, r);
    }
    return n;
}

static loom_jinja_node_t *parse_concat(parser_t *ps) {
    loom_jinja_node_t *n = parse_math2(ps);
    while (n && is_op(ps, JOP_TILDE)) {
        loom_jinja_tok_t *t = cur(ps);
        next(ps);
        loom_jinja_node_t *r = parse_math2(ps);
        PCHECK(r);
        n = binop(ps, t, JOP_TILDE, n, r);
    }
    return n;
}

static loom_jinja_node_t *parse_math1(parser_t *ps) {
    loom_jinja_node_t *n = parse_concat(ps);
    while (n && (is_op(ps, JOP_ADD) || is_op(ps, JOP_SUB))) {
        loom_jinja_tok_t *t = cur(ps);
        next(ps);
        loom_jinja_node_t *r = parse_concat(ps);
        PCHECK(r);
        n = binop(ps, t, t->op, n, r);
    }
    return n;
}

static loom_jinja_node_t *parse_compare(parser_t *ps) {
    loom_jinja_node_t *n = parse_math1(ps);
    loom_jinja_node_t *last = NULL; /* the last comparison of this chain */
    for (;;) {
        PCHECK(n);
        loom_jinja_tok_t *t = cur(ps);
        int op = 0;
        if (t->kind == JT_OP && (t->op == JOP_EQ || t->op == JOP_NE || t->op == JOP_LT ||
                                 t->op == JOP_LE || t->op == JOP_GT || t->op == JOP_GE)) {
            op = t->op;
            next(ps);
        } else if (is_name(t, "in")) {
            op = JOP_IN;
            next(ps);
        } else if (is_name(t, "not") && is_name(peek(ps, 1), "in")) {
            op = JOP_NOTIN;
            next(ps);
            next(ps);
        } else {
            return n;
        }
        loom_jinja_node_t *r = parse_math1(ps);
        PCHECK(r);
        /* a chain a < b < c is (a < b) and (b < c) */
        loom_jinja_node_t *c = mk(ps, JN_COMPARE, t);
        PCHECK(c);
        c->op = op;
        c->a = last ? last->b : n;
        c->b = r;
        n = last ? binop(ps, t, JOP_AND, n, c) : c;
        PCHECK(n);
        last = c;
    }
}

static loom_jinja_node_t *parse_not(parser_t *ps) {
    loom_jinja_tok_t *t = cur(ps);
    if (is_name(t, "not")) {
        next(ps);
        if (++ps->depth > 200) return perr(ps, t, "expression nested too deeply");
        loom_jinja_node_t *n = mk(ps, JN_UNOP, t);
        PCHECK(n);
        n->op = JOP_NOT;
        PCHECK(n->a = parse_not(ps));
        ps->depth--;
        return n;
    }
    return parse_compare(ps);
}

static loom_jinja_node_t *parse_and(parser_t *ps) {
    loom_jinja_node_t *n = parse_not(ps);
    while (n && is_name(cur(ps), "and")) {
        loom_jinja_tok_t *t = cur(ps);
        next(ps);
        loom_jinja_node_t *r = parse_not(ps);
        PCHECK(r);
        n = binop(ps, t, JOP_AND, n, r);
    }
    return n;
}

static loom_jinja_node_t *parse_or(parser_t *ps) {
    loom_jinja_node_t *n = parse_and(ps);
    while (n && is_name(cur(ps), "or")) {
        loom_jinja_tok_t *t = cur(ps);
        next(ps);
        loom_jinja_node_t *r = parse_and(ps);
        PCHECK(r);
        n = binop(ps, t, JOP_OR, n, r);
    }
    return n;
}

static loom_jinja_node_t *parse_expr(parser_t *ps) {
    loom_jinja_node_t *n = parse_or(ps);
    while (n && is_name(cur(ps), "if")) {
        loom_jinja_tok_t *t = cur(ps);
        if (++ps->depth > 200) return perr(ps, t, "expression nested too deeply");
        next(ps);
        loom_jinja_node_t *c = mk(ps, JN_CONDEXPR, t);
        PCHECK(c);
        c->b = n;
        PCHECK(c->a = parse_or(ps));
        if (is_name(cur(ps), "else")) {
            next(ps);
            PCHECK(c->c3 = parse_expr(ps));
        }
        n = c;
        ps->depth--;
    }
    return n;
}

/* An expression that may be a bare tuple (set values, for iterables). */
static loom_jinja_node_t *parse_tuple_expr(parser_t *ps) {
    loom_jinja_tok_t *t = cur(ps);
    loom_jinja_node_t *e = parse_expr(ps);
    PCHECK(e);
    if (!is_op(ps, JOP_COMMA)) return e;
    loom_jinja_node_t *tp = mk(ps, JN_TUPLE, t);
    PCHECK(tp);
    if (!nodes_push(ps, &tp->args, e)) return NULL;
    while (accept_op(ps, JOP_COMMA)) {
        if (cur(ps)->kind == JT_BLOCK_END || cur(ps)->kind == JT_VAR_END) break;
        PCHECK(e = parse_expr(ps));
        if (!nodes_push(ps, &tp->args, e)) return NULL;
    }
    return tp;
}

/* Assignment target: name, name.attr, or names separated by commas. */
static loom_jinja_node_t *parse_target(parser_t *ps, bool allow_attr) {
    loom_jinja_tok_t *t = cur(ps);
    loom_jinja_node_t *first = NULL, *tp = NULL;
    bool paren = accept_op(ps, JOP_LPAREN);
    for (;;) {
        loom_jinja_tok_t *n = cur(ps);
        if (n->kind != JT_NAME) return perr(ps, n, "expected a name to assign to");
        loom_jinja_node_t *x = mk(ps, JN_NAME, n);
        PCHECK(x);
        x->name = dupname(ps, n);
        x->name_len = n->len;
        next(ps);
        if (allow_attr && is_op(ps, JOP_DOT)) {
            next(ps);
            loom_jinja_tok_t *a = cur(ps);
            if (a->kind != JT_NAME) return perr(ps, a, "expected an attribute name");
            loom_jinja_node_t *r = mk(ps, JN_NSREF, n);
            PCHECK(r);
            r->a = x;
            r->name = dupname(ps, a);
            r->name_len = a->len;
            next(ps);
            return r;
        }
        if (!first) {
            first = x;
        } else {
            if (!tp) {
                PCHECK(tp = mk(ps, JN_TUPLE, t));
                if (!nodes_push(ps, &tp->args, first)) return NULL;
            }
            if (!nodes_push(ps, &tp->args, x)) return NULL;
        }
        if (!accept_op(ps, JOP_COMMA)) break;
        if (!tp) {
            PCHECK(tp = mk(ps, JN_TUPLE, t));
            if (!nodes_push(ps, &tp->args, first)) return NULL;
        }
        if (cur(ps)->kind != JT_NAME) break;
    }
    if (paren && !expect_op(ps, JOP_RPAREN, ")")) return NULL;
    return tp ? tp : first;
}

static bool expect_block_end(parser_t *ps) {
    if (cur(ps)->kind == JT_BLOCK_END) {
        next(ps);
        return true;
    }
    char b[64];
    perr(ps, cur(ps), "expected end of statement '%%}', got %s", tok_desc(cur(ps), b, sizeof b));
    return false;
}

/* Parses statements until {% NAME %} for one of the names in ENDS (NULL-terminated);
 * leaves the parser on that name and returns its index, or -1 on error. */
static int parse_body(parser_t *ps, loom_jinja_nodes_t *body, const char *const *ends,
                      const loom_jinja_tok_t *opener);

static loom_jinja_node_t *parse_macro_params(parser_t *ps, loom_jinja_node_t *m) {
    if (!expect_op(ps, JOP_LPAREN, "(")) return NULL;
    while (!is_op(ps, JOP_RPAREN)) {
        if (m->params.n && !expect_op(ps, JOP_COMMA, ",")) return NULL;
        if (is_op(ps, JOP_RPAREN)) break;
        loom_jinja_tok_t *t = cur(ps);
        if (t->kind != JT_NAME) return perr(ps, t, "expected a parameter name");
        loom_jinja_node_t *p = mk(ps, JN_NAME, t);
        PCHECK(p);
        p->name = dupname(ps, t);
        p->name_len = t->len;
        next(ps);
        if (accept_op(ps, JOP_ASSIGN)) PCHECK(p->a = parse_expr(ps));
        if (!nodes_push(ps, &m->params, p)) return NULL;
    }
    next(ps);
    return m;
}

/* Whether the tree under N reads the name NAME. */
static bool uses_name(const loom_jinja_node_t *n, const char *name) {
    if (!n) return false;
    if (n->kind == JN_NAME && strcmp(n->name, name) == 0) return true;
    const loom_jinja_node_t *kids[] = {n->a, n->b, n->c3, n->target, n->iter, n->cond};
    for (size_t i = 0; i < sizeof kids / sizeof kids[0]; i++)
        if (uses_name(kids[i], name)) return true;
    const loom_jinja_nodes_t *lists[] = {&n->args, &n->kwargs, &n->body, &n->else_body, &n->params};
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++)
        for (int k = 0; k < lists[i]->n; k++)
            if (uses_name(lists[i]->v[k], name)) return true;
    return false;
}

static void note_varargs(loom_jinja_node_t *m) {
    for (int k = 0; k < m->body.n; k++) {
        m->uses_varargs = m->uses_varargs || uses_name(m->body.v[k], "varargs");
        m->uses_kwargs = m->uses_kwargs || uses_name(m->body.v[k], "kwargs");
    }
}

static loom_jinja_node_t *parse_statement(parser_t *ps) {
    loom_jinja_tok_t *open = cur(ps); /* the {% */
    next(ps);
    loom_jinja_tok_t *t = cur(ps);
    if (t->kind != JT_NAME) return perr(ps, t, "expected a statement name");
    if (++ps->depth > 200) return perr(ps, t, "statements nested too deeply");
    loom_jinja_node_t *n = NULL;
    char b[64];
    if (is_name(t, "if")) {
        next(ps);
        PCHECK(n = mk(ps, JN_IF, t));
        PCHECK(n->a = parse_tuple_expr(ps));
        if (!expect_block_end(ps)) return NULL;
        loom_jinja_node_t *cur_if = n;
        for (;;) {
            static const char *const ends[] = {"elif", "else", "endif", NULL};
            int e = parse_body(ps, &cur_if->body, ends, open);
            if (e < 0) return NULL;
            next(ps);
            if (e == 0) {
                loom_jinja_node_t *el = mk(ps, JN_IF, cur(ps));
                PCHECK(el);
                PCHECK(el->a = parse_tuple_expr(ps));
                if (!expect_block_end(ps)) return NULL;
                if (!nodes_push(ps, &cur_if->else_body, el)) return NULL;
                cur_if = el;
            } else if (e == 1) {
                if (!expect_block_end(ps)) return NULL;
                static const char *const ends2[] = {"endif", NULL};
                if (parse_body(ps, &cur_if->else_body, ends2, open) < 0) return NULL;
                next(ps);
                break;
            } else {
                break;
            }
        }
    } else if (is_name(t, "for")) {
        next(ps);
        PCHECK(n = mk(ps, JN_FOR, t));
        PCHECK(n->target = parse_target(ps, false));
        if (!is_name(cur(ps), "in")) return perr(ps, cur(ps), "expected 'in' in for loop");
        next(ps);
        PCHECK(n->iter = parse_or(ps)); /* no conditional expression: 'if' filters */
        if (is_op(ps, JOP_COMMA)) return perr(ps, cur(ps), "tuple iterables are not supported");
        if (is_name(cur(ps), "if")) {
            next(ps);
            PCHECK(n->cond = parse_expr(ps));
        }
        if (is_name(cur(ps), "recursive"))
            return perr(ps, cur(ps), "recursive loops are not supported");
        if (!expect_block_end(ps)) return NULL;
        static const char *const ends[] = {"else", "endfor", NULL};
        int e = parse_body(ps, &n->body, ends, open);
        if (e < 0) return NULL;
        next(ps);
        if (e == 0) {
            if (!expect_block_end(ps)) return NULL;
            static const char *const ends2[] = {"endfor", NULL};
            if (parse_body(ps, &n->else_body, ends2, open) < 0) return NULL;
            next(ps);
        }
    } else if (is_name(t, "set")) {
        next(ps);
        loom_jinja_node_t *target = parse_target(ps, true);
        PCHECK(target);
        if (accept_op(ps, JOP_ASSIGN)) {
            PCHECK(n = mk(ps, JN_SET, t));
            n->target = target;
            PCHECK(n->iter = parse_tuple_expr(ps));
        } else {
            PCHECK(n = mk(ps, JN_SET_BLOCK, t));
            n->target = target;
            loom_jinja_node_t *f = NULL;
            while (is_op(ps, JOP_PIPE)) {
                loom_jinja_node_t *dummy = f;
                PCHECK(f = parse_filter(ps, dummy));
            }
            n->iter = f;
            if (!expect_block_end(ps)) return NULL;
            static const char *const ends[] = {"endset", NULL};
            if (parse_body(ps, &n->body, ends, open) < 0) return NULL;
            next(ps);
        }
    } else if (is_name(t, "macro")) {
        next(ps);
        PCHECK(n = mk(ps, JN_MACRO, t));
        if (cur(ps)->kind != JT_NAME) return perr(ps, cur(ps), "expected a macro name");
        n->name = dupname(ps, cur(ps));
        n->name_len = cur(ps)->len;
        next(ps);
        PCHECK(parse_macro_params(ps, n));
        if (!expect_block_end(ps)) return NULL;
        static const char *const ends[] = {"endmacro", NULL};
        if (parse_body(ps, &n->body, ends, open) < 0) return NULL;
        note_varargs(n);
        next(ps);
        if (cur(ps)->kind == JT_NAME) next(ps); /* {% endmacro name %} */
    } else if (is_name(t, "call")) {
        next(ps);
        PCHECK(n = mk(ps, JN_CALL_BLOCK, t));
        if (is_op(ps, JOP_LPAREN)) PCHECK(parse_macro_params(ps, n));
        PCHECK(n->iter = parse_expr(ps));
        if (n->iter->kind != JN_CALL) return perr(ps, t, "expected a call after 'call'");
        if (!expect_block_end(ps)) return NULL;
        static const char *const ends[] = {"endcall", NULL};
        if (parse_body(ps, &n->body, ends, open) < 0) return NULL;
        note_varargs(n);
        next(ps);
    } else if (is_name(t, "filter")) {
        PCHECK(n = mk(ps, JN_FILTER_BLOCK, t));
        loom_jinja_node_t *f = NULL;
        /* the filter statement's name token stands in for the first '|' */
        do {
            loom_jinja_node_t *dummy = f;
            PCHECK(f = parse_filter(ps, dummy));
        } while (is_op(ps, JOP_PIPE));
        n->iter = f;
        if (!expect_block_end(ps)) return NULL;
        static const char *const ends[] = {"endfilter", NULL};
        if (parse_body(ps, &n->body, ends, open) < 0) return NULL;
        next(ps);
    } else if (is_name(t, "generation")) {
        next(ps);
        PCHECK(n = mk(ps, JN_BODY, t));
        if (!expect_block_end(ps)) return NULL;
        static const char *const ends[] = {"endgeneration", NULL};
        if (parse_body(ps, &n->body, ends, open) < 0) return NULL;
        next(ps);
    } else if (is_name(t, "break") || is_name(t, "continue")) {
        PCHECK(n = mk(ps, t->s[0] == 'b' ? JN_BREAK : JN_CONTINUE, t));
        next(ps);
    } else {
        return perr(ps, t, "unknown tag %s", tok_desc(t, b, sizeof b));
    }
    if (!expect_block_end(ps)) return NULL;
    ps->depth--;
    return n;
}

static int parse_body(parser_t *ps, loom_jinja_nodes_t *body, const char *const *ends,
                      const loom_jinja_tok_t *opener) {
    char b[64];
    for (;;) {
        loom_jinja_tok_t *t = cur(ps);
        if (t->kind == JT_EOF) {
            if (ends) {
                int last = 0;
                while (ends[last + 1])
                    last++;
                perr(ps, opener ? opener : t, "unexpected end of template: missing '{%% %s %%}'",
                     ends[last]);
                return -1;
            }
            return 0;
        }
        if (t->kind == JT_TEXT) {
            loom_jinja_node_t *n = mk(ps, JN_TEXT, t);
            if (!n) return -1;
            n->c.type = JV_STR;
            n->c.s = t->s;
            n->c.len = t->len;
            next(ps);
            if (!nodes_push(ps, body, n)) return -1;
        } else if (t->kind == JT_VAR_BEGIN) {
            next(ps);
            loom_jinja_node_t *n = mk(ps, JN_OUTPUT, t);
            if (!n || !(n->a = parse_tuple_expr(ps))) return -1;
            if (cur(ps)->kind != JT_VAR_END) {
                perr(ps, cur(ps), "expected end of print statement '}}', got %s",
                     tok_desc(cur(ps), b, sizeof b));
                return -1;
            }
            next(ps);
            if (!nodes_push(ps, body, n)) return -1;
        } else if (t->kind == JT_BLOCK_BEGIN) {
            loom_jinja_tok_t *nm = peek(ps, 1);
            if (nm->kind == JT_NAME) {
                static const char *const closers[] = {
                    "elif",    "else",      "endif",         "endfor", "endset", "endmacro",
                    "endcall", "endfilter", "endgeneration", "endraw", NULL};
                for (int k = 0; ends && ends[k]; k++)
                    if (is_name(nm, ends[k])) {
                        next(ps);
                        return k;
                    }
                for (int k = 0; closers[k]; k++)
                    if (is_name(nm, closers[k])) {
                        perr(ps, nm, "unexpected '%s'", closers[k]);
                        return -1;
                    }
            }
            loom_jinja_node_t *n = parse_statement(ps);
            if (!n || !nodes_push(ps, body, n)) return -1;
        } else {
            perr(ps, t, "unexpected %s", tok_desc(t, b, sizeof b));
            return -1;
        }
    }
}

loom_status_t loom_jinja_parse(loom_jinja_t *t, loom_jinja_lex_t *lx, loom_err_t *err) {
    loom_err_t local = {0};
    parser_t ps = {.lx = lx, .tk = lx->toks, .pool = t->pool, .err = err ? err : &local};
    ps.err->code = LOOM_OK;
    if (parse_body(&ps, &t->body, NULL, NULL) < 0)
        return ps.err->code < 0 ? ps.err->code : LOOM_ERR_INVALID_ARGUMENT;
    return LOOM_OK;
}

loom_status_t loom_jinja_compile(const char *src, size_t len, const char *name, loom_jinja_t **out,
                                 loom_err_t *err) {
    *out = NULL;
    if (!name) name = "template";
    loom_jinja_t *t = calloc(1, sizeof *t);
    loom_jinja_pool_t *pool = calloc(1, sizeof *pool);
    char *nm = strdup(name);
    char *copy = pool ? loom_jinja_pool_alloc(pool, len + 1) : NULL;
    if (!t || !pool || !nm || !copy) {
        free(t), free(nm);
        if (pool) loom_jinja_pool_free(pool);
        free(pool);
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory compiling %s", name);
    }
    t->pool = pool;
    t->name = nm;
    size_t n = 0;
    for (size_t i = 0; i < len; i++) { /* \r\n and \r become \n */
        if (src[i] == '\r') {
            copy[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            copy[n++] = src[i];
        }
    }
    if (n && copy[n - 1] == '\n') n--; /* keep_trailing_newline=False */
    copy[n] = '\0';
    loom_jinja_lex_t lx = {.name = nm, .src = copy, .len = n, .pool = pool, .err = err};
    loom_status_t s = loom_jinja_lex_all(&lx);
    if (s == LOOM_OK) s = loom_jinja_parse(t, &lx, err);
    free(lx.toks);
    if (s != LOOM_OK) {
        if (s == LOOM_ERR_NOMEM) loom_err_set(err, s, "out of memory compiling %s", name);
        loom_jinja_destroy(&t);
        return s;
    }
    *out = t;
    return LOOM_OK;
}

void loom_jinja_destroy(loom_jinja_t **t_p) {
    if (!t_p || !*t_p) return;
    loom_jinja_t *t = *t_p;
    if (t->pool) loom_jinja_pool_free(t->pool);
    free(t->pool);
    free(t->name);
    free(t);
    *t_p = NULL;
}

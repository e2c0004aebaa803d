/* GBNF-style grammars (as llama.cpp and xgrammar take them) to the grammar IR:
 *
 *   root   ::= object
 *   object ::= "{" ws ( pair ( "," ws pair )* )? "}"   # comments run to the line end
 *   ws     ::= [ \t\n]*
 *
 * Terminals are "strings" (escapes \n \t \r \\ \" \xHH \uXXXX) and classes
 * [a-z] / [^"]; "." is any character; items take * + ? {m} {m,} {m,n};
 * parentheses group. A rule may span lines: it ends where the next
 * "name ::=" starts. The start rule is named root. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar_impl.h"
#include "common/util.h"

typedef struct {
    loom_gb_t *gb;
    const char *s;
    size_t n, i;
    int depth;
    loom_err_t *err;
    loom_status_t st;
} eb_t;

static int line_of(const eb_t *p) {
    int l = 1;
    for (size_t k = 0; k < p->i && k < p->n; k++)
        l += p->s[k] == '\n';
    return l;
}

static void eb_fail(eb_t *p, const char *what) {
    if (p->st < 0) return;
    p->st = loom_err_set(p->err, LOOM_ERR_INVALID_ARGUMENT, "grammar syntax error at line %d: %s",
                         line_of(p), what);
}

static int is_name(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-' || c == '.';
}

static void eb_ws(eb_t *p) {
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == '#') {
            while (p->i < p->n && p->s[p->i] != '\n')
                p->i++;
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            p->i++;
        } else {
            break;
        }
    }
}

/* At a "name ::=" (the start of the next rule)? */
static int at_rule_start(const eb_t *p) {
    size_t k = p->i;
    if (k >= p->n || !is_name(p->s[k]) || p->s[k] == '.') return 0;
    while (k < p->n && is_name(p->s[k]))
        k++;
    while (k < p->n && (p->s[k] == ' ' || p->s[k] == '\t'))
        k++;
    return k + 3 <= p->n && memcmp(p->s + k, "::=", 3) == 0;
}

static int hexv(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static void put_utf8(char *out, size_t *k, uint32_t cp) {
    if (cp < 0x80) {
        out[(*k)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*k)++] = (char)(0xC0 | (cp >> 6));
        out[(*k)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*k)++] = (char)(0xE0 | (cp >> 12));
        out[(*k)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*k)++] = (char)(0x80 | (cp & 0x3F));
    }
}

/* A "literal" at p->i (at the quote): a rule matching its bytes. */
static int eb_literal(eb_t *p) {
    char q = p->s[p->i++];
    char *buf = loom_xmalloc(p->n + 1);
    size_t k = 0;
    while (p->st >= 0) {
        if (p->i >= p->n) {
            eb_fail(p, "unterminated string");
            break;
        }
        char c = p->s[p->i++];
        if (c == q) break;
        if (c != '\\') {
            buf[k++] = c;
            continue;
        }
        if (p->i >= p->n) {
            eb_fail(p, "unterminated string");
            break;
        }
        char e = p->s[p->i++];
        switch (e) {
        case 'n':
            buf[k++] = '\n';
            break;
        case 't':
            buf[k++] = '\t';
            break;
        case 'r':
            buf[k++] = '\r';
            break;
        case '\\':
        case '"':
        case '\'':
        case '[':
        case ']':
            buf[k++] = e;
            break;
        case 'x':
        case 'u': {
            int nd = e == 'x' ? 2 : 4;
            uint32_t v = 0;
            for (int d = 0; d < nd; d++) {
                int h = p->i < p->n ? hexv(p->s[p->i]) : -1;
                if (h < 0) {
                    eb_fail(p, "bad \\x or \\u escape");
                    break;
                }
                v = v * 16 + (uint32_t)h;
                p->i++;
            }
            if (e == 'x')
                buf[k++] = (char)v;
            else
                put_utf8(buf, &k, v);
            break;
        }
        default:
            eb_fail(p, "unknown escape in string");
            break;
        }
    }
    int rule = -1;
    if (p->st >= 0) rule = loom_gb_lit_rule(p->gb, buf, k);
    free(buf);
    return rule;
}

static int eb_alts(eb_t *p);

static int eb_atom(eb_t *p) {
    char c = p->s[p->i];
    if (c == '"' || c == '\'') return eb_literal(p);
    if (c == '[') {
        p->i++;
        int rule = -1;
        loom_err_t e2;
        loom_status_t st = loom_regex_class(p->gb, p->s, p->n, &p->i, &rule, &e2);
        if (st < 0) {
            if (p->st >= 0)
                p->st = loom_err_set(p->err, st, "grammar syntax error at line %d: %s", line_of(p),
                                     e2.msg);
            return -1;
        }
        return rule;
    }
    if (c == '(') {
        p->i++;
        if (++p->depth > 200) {
            eb_fail(p, "groups nested too deep");
            return -1;
        }
        int r = eb_alts(p);
        p->depth--;
        if (p->st < 0) return -1;
        eb_ws(p);
        if (p->i >= p->n || p->s[p->i] != ')') {
            eb_fail(p, "missing ')'");
            return -1;
        }
        p->i++;
        return r;
    }
    if (c == '.') {
        p->i++;
        return loom_gb_utf8_char(p->gb, NULL);
    }
    if (is_name(c)) {
        size_t b = p->i;
        while (p->i < p->n && is_name(p->s[p->i]))
            p->i++;
        return loom_gb_rule_named(p->gb, p->s + b, p->i - b);
    }
    eb_fail(p, "expected a string, a [class], a rule name or '('");
    return -1;
}

static int eb_int(eb_t *p, int *v) {
    int got = 0;
    long x = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        x = x * 10 + (p->s[p->i++] - '0');
        if (x > 100000) x = 100000;
        got = 1;
    }
    *v = (int)x;
    return got;
}

static int eb_seq(eb_t *p) {
    int rule = loom_gb_rule(p->gb, NULL);
    loom_gb_alt(p->gb, rule);
    for (;;) {
        eb_ws(p);
        if (p->i >= p->n || p->s[p->i] == '|' || p->s[p->i] == ')' || at_rule_start(p)) break;
        int a = eb_atom(p);
        if (p->st < 0) return -1;
        int min = 1, max = 1;
        if (p->i < p->n) {
            char q = p->s[p->i];
            if (q == '*')
                min = 0, max = -1, p->i++;
            else if (q == '+')
                min = 1, max = -1, p->i++;
            else if (q == '?')
                min = 0, max = 1, p->i++;
            else if (q == '{') {
                p->i++;
                if (!eb_int(p, &min)) {
                    eb_fail(p, "bad {m,n} repetition");
                    return -1;
                }
                max = min;
                if (p->i < p->n && p->s[p->i] == ',') {
                    p->i++;
                    if (!eb_int(p, &max)) max = -1;
                }
                if (p->i >= p->n || p->s[p->i] != '}') {
                    eb_fail(p, "bad {m,n} repetition");
                    return -1;
                }
                p->i++;
                if (max >= 0 && max < min) {
                    eb_fail(p, "repetition {m,n} with n < m");
                    return -1;
                }
                if (min > 4096 || max > 4096) {
                    eb_fail(p, "repetition count above 4096");
                    return -1;
                }
            }
        }
        if (min == 1 && max == 1)
            loom_gb_add_ref(p->gb, rule, a);
        else
            loom_gb_add_ref(p->gb, rule, loom_gb_repeat(p->gb, a, min, max));
    }
    return rule;
}

static int eb_alts(eb_t *p) {
    int rule = loom_gb_rule(p->gb, NULL);
    for (;;) {
        int s = eb_seq(p);
        if (p->st < 0) return -1;
        loom_gb_alt(p->gb, rule);
        loom_gb_add_ref(p->gb, rule, s);
        eb_ws(p);
        if (p->i < p->n && p->s[p->i] == '|') {
            p->i++;
            continue;
        }
        return rule;
    }
}

loom_status_t loom_grammar_compile_ebnf(const char *text, size_t len, loom_grammar_t **out,
                                        loom_err_t *err) {
    eb_t p = {.gb = loom_gb_create(), .s = text, .n = len, .err = err, .st = LOOM_OK};
    int n_defs = 0;
    for (;;) {
        eb_ws(&p);
        if (p.i >= p.n) break;
        if (!at_rule_start(&p)) {
            eb_fail(&p, "expected 'name ::='");
            break;
        }
        size_t b = p.i;
        while (p.i < p.n && is_name(p.s[p.i]))
            p.i++;
        int rule = loom_gb_rule_named(p.gb, p.s + b, p.i - b);
        if (loom_gb_is_defined(p.gb, rule)) {
            eb_fail(&p, "rule defined twice");
            break;
        }
        while (p.s[p.i] != ':')
            p.i++;
        p.i += 3;
        int body = eb_alts(&p);
        if (p.st < 0) break;
        if (p.i < p.n && p.s[p.i] == ')') {
            eb_fail(&p, "unbalanced ')'");
            break;
        }
        loom_gb_alt(p.gb, rule);
        loom_gb_add_ref(p.gb, rule, body);
        n_defs++;
    }
    if (p.st >= 0 && n_defs == 0) eb_fail(&p, "empty grammar");
    int root = -1;
    if (p.st >= 0) {
        root = loom_gb_rule_named(p.gb, "root", 4);
        if (!loom_gb_is_defined(p.gb, root))
            p.st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar: no rule named 'root'");
    }
    if (p.st < 0) {
        loom_gb_destroy(&p.gb);
        return p.st;
    }
    return loom_gb_finish(&p.gb, root, out, err);
}

/* Regular expressions to grammar rules: the subset that guided_regex and
 * JSON Schema "pattern" use in practice -- literals, escapes (\d \w \s and
 * their negations, \n \t \xHH \uXXXX, escaped punctuation), classes with
 * ranges and negation, ".", groups ((...), (?:...)), alternation and the
 * quantifiers * + ? {n} {n,} {n,m} (lazy forms match the same language).
 * ^ and $ are accepted at the ends. Lookaround and backreferences are
 * refused by name. The whole input must match the expression.
 *
 * In JSON-string mode (for "pattern") the rules produce the body of a JSON
 * string: a '"' or '\' the expression allows is written escaped, control
 * characters are never produced. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar_impl.h"
#include "common/util.h"

typedef struct {
    loom_gb_t *gb;
    const unsigned char *s;
    size_t n, i;
    int json; /* JSON-string mode */
    int depth;
    loom_err_t *err;
    loom_status_t st;
    int any_mb; /* rule: one multi-byte UTF-8 character (-1 until made) */
} rx_t;

/* A character class: ASCII bytes plus (optionally) every multi-byte
 * character plus listed multi-byte characters (as literal byte strings). */
typedef struct {
    loom_gb_set_t ascii;
    int all_mb;
    char (*mb)[4];
    int *mb_len;
    int n_mb;
} cls_t;

static void rx_fail(rx_t *r, loom_status_t code, const char *what) {
    if (r->st < 0) return;
    r->st = loom_err_set(r->err, code, "regex: %s at offset %zu", what, r->i);
}

static int rx_any_mb(rx_t *r) {
    if (r->any_mb < 0) {
        loom_gb_set_t none = {{0}};
        r->any_mb = loom_gb_utf8_char(r->gb, &none);
    }
    return r->any_mb;
}

static void cls_add_cp(cls_t *c, uint32_t cp) {
    if (cp < 0x80) {
        loom_gb_set_add(&c->ascii, cp);
        return;
    }
    char buf[4];
    int n;
    if (cp < 0x800) {
        buf[0] = (char)(0xC0 | (cp >> 6));
        buf[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        buf[0] = (char)(0xE0 | (cp >> 12));
        buf[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        buf[0] = (char)(0xF0 | (cp >> 18));
        buf[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        buf[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    c->mb = loom_xrealloc(c->mb, (size_t)(c->n_mb + 1) * sizeof *c->mb);
    c->mb_len = loom_xrealloc(c->mb_len, (size_t)(c->n_mb + 1) * sizeof *c->mb_len);
    memcpy(c->mb[c->n_mb], buf, (size_t)n);
    c->mb_len[c->n_mb++] = n;
}

static void cls_free(cls_t *c) {
    free(c->mb);
    free(c->mb_len);
}

static void set_digits(loom_gb_set_t *s) {
    loom_gb_set_range(s, '0', '9');
}
static void set_word(loom_gb_set_t *s) {
    loom_gb_set_range(s, '0', '9');
    loom_gb_set_range(s, 'a', 'z');
    loom_gb_set_range(s, 'A', 'Z');
    loom_gb_set_add(s, '_');
}
static void set_space(loom_gb_set_t *s) {
    const char *sp = " \t\n\r\f\v";
    for (; *sp; sp++)
        loom_gb_set_add(s, (unsigned char)*sp);
}

/* The rule for a class. */
static int cls_rule(rx_t *r, cls_t *c) {
    int rule = loom_gb_rule(r->gb, NULL);
    loom_gb_set_t a = c->ascii;
    int quote = 0, bslash = 0;
    for (unsigned x = 0x80; x < 256; x++)
        a.b[x >> 3] = (uint8_t)(a.b[x >> 3] & ~(1u << (x & 7)));
    if (r->json) {
        for (unsigned x = 0; x < 0x20; x++)
            a.b[x >> 3] = (uint8_t)(a.b[x >> 3] & ~(1u << (x & 7)));
        quote = loom_gb_set_has(&a, '"');
        bslash = loom_gb_set_has(&a, '\\');
        a.b['"' >> 3] = (uint8_t)(a.b['"' >> 3] & ~(1u << ('"' & 7)));
        a.b['\\' >> 3] = (uint8_t)(a.b['\\' >> 3] & ~(1u << ('\\' & 7)));
    }
    loom_gb_alt(r->gb, rule);
    loom_gb_add_set(r->gb, rule, &a); /* an empty set is dropped at finish */
    if (quote) {
        loom_gb_alt(r->gb, rule);
        loom_gb_add_lit(r->gb, rule, "\\\"", 2);
    }
    if (bslash) {
        loom_gb_alt(r->gb, rule);
        loom_gb_add_lit(r->gb, rule, "\\\\", 2);
    }
    if (c->all_mb) {
        loom_gb_alt(r->gb, rule);
        loom_gb_add_ref(r->gb, rule, rx_any_mb(r));
    } else {
        for (int k = 0; k < c->n_mb; k++) {
            loom_gb_alt(r->gb, rule);
            loom_gb_add_lit(r->gb, rule, c->mb[k], (size_t)c->mb_len[k]);
        }
    }
    return rule;
}

static uint32_t rx_utf8(rx_t *r) {
    /* decodes one UTF-8 character at r->i (the input is taken as UTF-8) */
    unsigned char c = r->s[r->i];
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (r->i + (size_t)n > r->n || (c >= 0x80 && c < 0xC2)) {
        rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "invalid UTF-8");
        r->i = r->n;
        return 0;
    }
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1Fu) : n == 3 ? (c & 0x0Fu) : (c & 0x07u);
    for (int k = 1; k < n; k++)
        cp = (cp << 6) | (r->s[r->i + (size_t)k] & 0x3Fu);
    r->i += (size_t)n;
    return cp;
}

static int hexval(int c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* An escape after '\' (r->i at the letter). Adds to c; returns 1 when it was
 * a class escape (\d ...), 0 for a single code point in *cp. */
static int rx_escape(rx_t *r, cls_t *c, uint32_t *cp) {
    if (r->i >= r->n) {
        rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "trailing backslash");
        return 0;
    }
    unsigned char e = r->s[r->i++];
    loom_gb_set_t s = {{0}};
    switch (e) {
    case 'd':
        set_digits(&c->ascii);
        return 1;
    case 'w':
        set_word(&c->ascii);
        return 1;
    case 's':
        set_space(&c->ascii);
        return 1;
    case 'D':
    case 'W':
    case 'S':
        if (e == 'D') set_digits(&s);
        if (e == 'W') set_word(&s);
        if (e == 'S') set_space(&s);
        for (unsigned x = 0; x < 0x80; x++)
            if (!loom_gb_set_has(&s, x)) loom_gb_set_add(&c->ascii, x);
        c->all_mb = 1;
        return 1;
    case 'n':
        *cp = '\n';
        return 0;
    case 't':
        *cp = '\t';
        return 0;
    case 'r':
        *cp = '\r';
        return 0;
    case 'f':
        *cp = '\f';
        return 0;
    case 'v':
        *cp = '\v';
        return 0;
    case '0':
        *cp = 0;
        return 0;
    case 'x':
    case 'u': {
        int nd = e == 'x' ? 2 : 4;
        uint32_t v = 0;
        for (int k = 0; k < nd; k++) {
            int h = r->i < r->n ? hexval(r->s[r->i]) : -1;
            if (h < 0) {
                rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "bad \\x or \\u escape");
                return 0;
            }
            v = v * 16 + (uint32_t)h;
            r->i++;
        }
        *cp = v;
        return 0;
    }
    case 'b':
    case 'B':
        rx_fail(r, LOOM_ERR_UNSUPPORTED, "word boundary (\\b, \\B) is not supported");
        return 0;
    default:
        if ((e >= '1' && e <= '9') || e == 'k') {
            rx_fail(r, LOOM_ERR_UNSUPPORTED, "backreferences are not supported");
            return 0;
        }
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
            rx_fail(r, LOOM_ERR_UNSUPPORTED, "unknown escape");
            return 0;
        }
        r->i--;
        *cp = rx_utf8(r);
        return 0;
    }
}

static int rx_class(rx_t *r) {
    /* r->i just after '[' */
    cls_t c = {0};
    int neg = 0;
    if (r->i < r->n && r->s[r->i] == '^') neg = 1, r->i++;
    int first = 1;
    while (r->st >= 0) {
        if (r->i >= r->n) {
            rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "unterminated character class");
            break;
        }
        unsigned char ch = r->s[r->i];
        if (ch == ']' && !first) {
            r->i++;
            break;
        }
        first = 0;
        uint32_t lo;
        if (ch == '\\') {
            r->i++;
            if (rx_escape(r, &c, &lo)) continue;
        } else {
            lo = rx_utf8(r);
        }
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            uint32_t hi;
            if (r->s[r->i] == '\\') {
                r->i++;
                if (rx_escape(r, &c, &hi)) {
                    rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "class escape as a range end");
                    break;
                }
            } else {
                hi = rx_utf8(r);
            }
            if (hi < lo) {
                rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "range out of order in character class");
                break;
            }
            if (hi >= 0x80 && hi - lo > 256) {
                /* wide non-ASCII ranges: every multi-byte character */
                if (lo < 0x80) loom_gb_set_range(&c.ascii, lo, 0x7F);
                c.all_mb = 1;
            } else {
                for (uint32_t x = lo; x <= hi; x++)
                    cls_add_cp(&c, x);
            }
        } else {
            cls_add_cp(&c, lo);
        }
    }
    int rule = -1;
    if (r->st >= 0) {
        if (neg) {
            if (c.n_mb) {
                rx_fail(r, LOOM_ERR_UNSUPPORTED, "non-ASCII characters in a negated class");
            } else {
                cls_t n = {0};
                for (unsigned x = 0; x < 0x80; x++)
                    if (!loom_gb_set_has(&c.ascii, x)) loom_gb_set_add(&n.ascii, x);
                n.all_mb = !c.all_mb;
                rule = cls_rule(r, &n);
            }
        } else {
            rule = cls_rule(r, &c);
        }
    }
    cls_free(&c);
    return rule;
}

static int rx_alt(rx_t *r);

static int rx_atom(rx_t *r) {
    unsigned char ch = r->s[r->i];
    cls_t c = {0};
    int rule = -1;
    if (ch == '(') {
        r->i++;
        if (r->i < r->n && r->s[r->i] == '?') {
            if (r->i + 1 < r->n && r->s[r->i + 1] == ':') {
                r->i += 2;
            } else if (r->i + 1 < r->n && r->s[r->i + 1] == '<' && r->i + 2 < r->n &&
                       r->s[r->i + 2] != '=' && r->s[r->i + 2] != '!') {
                /* named group (?<name>...) */
                while (r->i < r->n && r->s[r->i] != '>')
                    r->i++;
                if (r->i >= r->n) {
                    rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "unterminated group name");
                    return -1;
                }
                r->i++;
            } else {
                rx_fail(r, LOOM_ERR_UNSUPPORTED, "lookaround and inline flags are not supported");
                return -1;
            }
        }
        if (++r->depth > 200) {
            rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "groups nested too deep");
            return -1;
        }
        rule = rx_alt(r);
        r->depth--;
        if (r->st < 0) return -1;
        if (r->i >= r->n || r->s[r->i] != ')') {
            rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "missing ')'");
            return -1;
        }
        r->i++;
        return rule;
    }
    if (ch == '[') {
        r->i++;
        return rx_class(r);
    }
    if (ch == '.') {
        r->i++;
        for (unsigned x = 0; x < 0x80; x++)
            if (x != '\n') loom_gb_set_add(&c.ascii, x);
        c.all_mb = 1;
        return cls_rule(r, &c);
    }
    if (ch == '*' || ch == '+' || ch == '?' || ch == '{') {
        rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "quantifier without anything to repeat");
        return -1;
    }
    if (ch == ')') {
        rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "unbalanced ')'");
        return -1;
    }
    uint32_t cp;
    if (ch == '\\') {
        r->i++;
        if (!rx_escape(r, &c, &cp)) cls_add_cp(&c, cp);
    } else {
        cls_add_cp(&c, rx_utf8(r));
    }
    if (r->st < 0) {
        cls_free(&c);
        return -1;
    }
    rule = cls_rule(r, &c);
    cls_free(&c);
    return rule;
}

static int rx_number(rx_t *r, int *v) {
    int got = 0;
    long x = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        x = x * 10 + (r->s[r->i++] - '0');
        if (x > 100000) x = 100000;
        got = 1;
    }
    *v = (int)x;
    return got;
}

/* A sequence of quantified atoms, as one rule. */
static int rx_seq(rx_t *r) {
    int rule = loom_gb_rule(r->gb, NULL);
    loom_gb_alt(r->gb, rule);
    while (r->st >= 0 && r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')') {
        if (r->s[r->i] == '^' || r->s[r->i] == '$') {
            int at_edge =
                (r->s[r->i] == '^' && r->i == 0) || (r->s[r->i] == '$' && r->i + 1 == r->n);
            if (!at_edge) {
                rx_fail(r, LOOM_ERR_UNSUPPORTED, "anchors inside the expression are not supported");
                return -1;
            }
            r->i++;
            continue;
        }
        int a = rx_atom(r);
        if (r->st < 0) return -1;
        int min = 1, max = 1;
        if (r->i < r->n) {
            unsigned char q = r->s[r->i];
            if (q == '*')
                min = 0, max = -1, r->i++;
            else if (q == '+')
                min = 1, max = -1, r->i++;
            else if (q == '?')
                min = 0, max = 1, r->i++;
            else if (q == '{') {
                size_t save = r->i;
                r->i++;
                int lo = 0, hi = 0;
                if (rx_number(r, &lo)) {
                    if (r->i < r->n && r->s[r->i] == '}') {
                        hi = lo;
                        r->i++;
                    } else if (r->i < r->n && r->s[r->i] == ',') {
                        r->i++;
                        if (!rx_number(r, &hi)) hi = -1;
                        if (r->i < r->n && r->s[r->i] == '}')
                            r->i++;
                        else
                            r->i = save;
                    } else {
                        r->i = save;
                    }
                } else {
                    r->i = save;
                }
                if (r->i == save) { /* a literal '{' */
                    cls_t c = {0};
                    loom_gb_add_ref(r->gb, rule, a);
                    cls_add_cp(&c, '{');
                    a = cls_rule(r, &c);
                    cls_free(&c);
                    r->i++;
                } else {
                    if (hi >= 0 && hi < lo) {
                        rx_fail(r, LOOM_ERR_INVALID_ARGUMENT, "repetition {n,m} with m < n");
                        return -1;
                    }
                    if (lo > 4096 || hi > 4096) {
                        rx_fail(r, LOOM_ERR_UNSUPPORTED, "repetition count above 4096");
                        return -1;
                    }
                    min = lo, max = hi;
                }
            }
            if (r->i < r->n && r->s[r->i] == '?' && (min != 1 || max != 1)) r->i++; /* lazy */
            if (r->i < r->n && r->s[r->i] == '+' && (min != 1 || max != 1)) {
                rx_fail(r, LOOM_ERR_UNSUPPORTED, "possessive quantifiers are not supported");
                return -1;
            }
        }
        if (min == 1 && max == 1)
            loom_gb_add_ref(r->gb, rule, a);
        else
            loom_gb_add_ref(r->gb, rule, loom_gb_repeat(r->gb, a, min, max));
    }
    return rule;
}

static int rx_alt(rx_t *r) {
    int rule = loom_gb_rule(r->gb, NULL);
    for (;;) {
        int s = rx_seq(r);
        if (r->st < 0) return -1;
        loom_gb_alt(r->gb, rule);
        loom_gb_add_ref(r->gb, rule, s);
        if (r->i < r->n && r->s[r->i] == '|') {
            r->i++;
            continue;
        }
        break;
    }
    return rule;
}

static loom_status_t regex_rule(loom_gb_t *gb, const char *re, size_t len, int json, int *rule,
                                loom_err_t *err) {
    rx_t r = {.gb = gb,
              .s = (const unsigned char *)re,
              .n = len,
              .json = json,
              .err = err,
              .st = LOOM_OK,
              .any_mb = -1};
    int x = rx_alt(&r);
    if (r.st >= 0 && r.i < r.n) rx_fail(&r, LOOM_ERR_INVALID_ARGUMENT, "unbalanced ')'");
    if (r.st < 0) return r.st;
    *rule = x;
    return LOOM_OK;
}

loom_status_t loom_regex_to_rule(loom_gb_t *gb, const char *re, size_t len, int json_string,
                                 int *rule, loom_err_t *err) {
    return regex_rule(gb, re, len, json_string, rule, err);
}

loom_status_t loom_grammar_compile_regex(const char *re, size_t len, loom_grammar_t **out,
                                         loom_err_t *err) {
    loom_gb_t *gb = loom_gb_create();
    int root = loom_gb_rule(gb, "root");
    int x;
    loom_status_t st = regex_rule(gb, re, len, 0, &x, err);
    if (st < 0) {
        loom_gb_destroy(&gb);
        return st;
    }
    loom_gb_alt(gb, root);
    loom_gb_add_ref(gb, root, x);
    return loom_gb_finish(&gb, root, out, err);
}

loom_status_t loom_regex_class(loom_gb_t *gb, const char *s, size_t n, size_t *i, int *rule,
                               loom_err_t *err) {
    rx_t r = {.gb = gb,
              .s = (const unsigned char *)s,
              .n = n,
              .i = *i,
              .json = 0,
              .err = err,
              .st = LOOM_OK,
              .any_mb = -1};
    int x = rx_class(&r);
    if (r.st < 0) return r.st;
    *i = r.i;
    *rule = x;
    return LOOM_OK;
}

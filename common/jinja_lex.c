/* Jinja lexer: template text to tokens, with jinja2's whitespace rules as
 * transformers configures them (trim_blocks, lstrip_blocks), the -/+ tag
 * modifiers, comments and raw blocks. Newlines are normalised to \n and one
 * trailing newline is dropped, as jinja2 does. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jinja_impl.h"

static bool is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static loom_status_t lex_error(loom_jinja_lex_t *lx, int line, int col, const char *what) {
    return loom_err_set(lx->err, LOOM_ERR_INVALID_ARGUMENT, "%s:%d:%d: %s", lx->name, line, col,
                        what);
}

/* Moves pos to NEWPOS, keeping line and col. */
static void adv_to(loom_jinja_lex_t *lx, size_t newpos) {
    for (size_t i = lx->pos; i < newpos; i++) {
        if (lx->src[i] == '\n') {
            lx->line++;
            lx->col = 1;
        } else {
            lx->col++;
        }
    }
    lx->pos = newpos;
}

static loom_jinja_tok_t *push(loom_jinja_lex_t *lx, loom_jinja_tok_kind_t kind, int line, int col) {
    if (lx->ntoks == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        loom_jinja_tok_t *t = realloc(lx->toks, cap * sizeof *t);
        if (!t) return NULL;
        lx->toks = t;
        lx->cap = cap;
    }
    loom_jinja_tok_t *t = &lx->toks[lx->ntoks++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    t->line = line;
    t->col = col;
    return t;
}

/* Emits text [a, b) after the whitespace control of the tag that follows it:
 * SIGN is the tag's modifier ('-', '+' or 0), BLOCK whether lstrip_blocks applies. */
static loom_status_t emit_text(loom_jinja_lex_t *lx, size_t a, size_t b, char sign, bool block,
                               int line, int col) {
    if (sign == '-') {
        while (b > a && is_ws(lx->src[b - 1]))
            b--;
    } else if (sign != '+' && block) {
        size_t l = b;
        while (l > a && lx->src[l - 1] != '\n')
            l--;
        if (l > a || lx->line_starting) {
            bool all_ws = l < b;
            for (size_t i = l; i < b; i++)
                if (!is_ws(lx->src[i])) all_ws = false;
            if (all_ws) b = l;
        }
    }
    if (b > a) {
        loom_jinja_tok_t *t = push(lx, JT_TEXT, line, col);
        if (!t) return LOOM_ERR_NOMEM;
        t->s = lx->src + a;
        t->len = b - a;
    }
    return LOOM_OK;
}

/* Python's string-literal escapes (unicode-escape), written as UTF-8. */
static size_t put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static loom_status_t lex_string(loom_jinja_lex_t *lx, loom_jinja_tok_t *t) {
    char q = lx->src[lx->pos];
    size_t i = lx->pos + 1;
    while (i < lx->len && lx->src[i] != q) {
        if (lx->src[i] == '\\' && i + 1 < lx->len) i++;
        i++;
    }
    if (i >= lx->len) return lex_error(lx, t->line, t->col, "unterminated string");
    size_t a = lx->pos + 1, b = i;
    char *o = loom_jinja_pool_alloc(lx->pool, (b - a) * 2 + 1);
    if (!o) return LOOM_ERR_NOMEM;
    size_t n = 0;
    for (size_t k = a; k < b; k++) {
        char c = lx->src[k];
        if (c != '\\' || k + 1 >= b) {
            o[n++] = c;
            continue;
        }
        char e = lx->src[++k];
        switch (e) {
        case '\n':
            break;
        case '\\':
            o[n++] = '\\';
            break;
        case '\'':
            o[n++] = '\'';
            break;
        case '"':
            o[n++] = '"';
            break;
        case 'a':
            o[n++] = '\a';
            break;
        case 'b':
            o[n++] = '\b';
            break;
        case 'f':
            o[n++] = '\f';
            break;
        case 'n':
            o[n++] = '\n';
            break;
        case 'r':
            o[n++] = '\r';
            break;
        case 't':
            o[n++] = '\t';
            break;
        case 'v':
            o[n++] = '\v';
            break;
        case 'x':
        case 'u':
        case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            int d = 0;
            for (; d < nd && k + 1 + (size_t)d < b; d++) {
                int h = hexval(lx->src[k + 1 + (size_t)d]);
                if (h < 0) break;
                cp = cp * 16 + (uint32_t)h;
            }
            if (d < nd || cp > 0x10FFFF)
                return lex_error(lx, t->line, t->col, "bad escape in string");
            k += (size_t)nd;
            n += put_utf8(o + n, cp);
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = (uint32_t)(e - '0');
                for (int d = 0;
                     d < 2 && k + 1 < b && lx->src[k + 1] >= '0' && lx->src[k + 1] <= '7'; d++)
                    cp = cp * 8 + (uint32_t)(lx->src[++k] - '0');
                n += put_utf8(o + n, cp);
            } else {
                o[n++] = '\\';
                o[n++] = e;
            }
        }
    }
    o[n] = '\0';
    t->kind = JT_STRING;
    t->s = o;
    t->len = n;
    adv_to(lx, i + 1);
    return LOOM_OK;
}

static loom_status_t lex_number(loom_jinja_lex_t *lx, loom_jinja_tok_t *t, bool after_dot) {
    const char *s = lx->src;
    size_t i = lx->pos;
    char buf[128];
    size_t n = 0;
    bool is_float = false;
    while (i < lx->len && (isdigit((unsigned char)s[i]) ||
                           (s[i] == '_' && i + 1 < lx->len && isdigit((unsigned char)s[i + 1])))) {
        if (s[i] != '_' && n < sizeof buf - 1) buf[n++] = s[i];
        i++;
    }
    if (!after_dot && i + 1 < lx->len && s[i] == '.' && isdigit((unsigned char)s[i + 1])) {
        is_float = true;
        if (n < sizeof buf - 1) buf[n++] = s[i];
        i++;
        while (i < lx->len && (isdigit((unsigned char)s[i]) || s[i] == '_')) {
            if (s[i] != '_' && n < sizeof buf - 1) buf[n++] = s[i];
            i++;
        }
    }
    if (!after_dot && i < lx->len && (s[i] == 'e' || s[i] == 'E')) {
        size_t j = i + 1;
        if (j < lx->len && (s[j] == '+' || s[j] == '-')) j++;
        if (j < lx->len && isdigit((unsigned char)s[j])) {
            is_float = true;
            while (i < j && n < sizeof buf - 1)
                buf[n++] = s[i++];
            while (i < lx->len && isdigit((unsigned char)s[i])) {
                if (n < sizeof buf - 1) buf[n++] = s[i];
                i++;
            }
        }
    }
    if (n >= sizeof buf - 1) return lex_error(lx, t->line, t->col, "number literal too long");
    buf[n] = '\0';
    if (is_float) {
        t->kind = JT_FLOAT;
        t->f = strtod(buf, NULL);
    } else {
        t->kind = JT_INT;
        char *end;
        unsigned long long v = strtoull(buf, &end, 10);
        if (n > 18 && (v > (unsigned long long)INT64_MAX || n > 19))
            return lex_error(lx, t->line, t->col, "integer literal too large");
        t->i = (int64_t)v;
    }
    adv_to(lx, i);
    return LOOM_OK;
}

static const struct {
    const char *s;
    int op;
} k_ops[] = {
    {"//", JOP_FLOORDIV}, {"**", JOP_POW},   {"==", JOP_EQ},      {"!=", JOP_NE},
    {"<=", JOP_LE},       {">=", JOP_GE},    {"+", JOP_ADD},      {"-", JOP_SUB},
    {"*", JOP_MUL},       {"/", JOP_DIV},    {"%", JOP_MOD},      {"~", JOP_TILDE},
    {"(", JOP_LPAREN},    {")", JOP_RPAREN}, {"[", JOP_LBRACKET}, {"]", JOP_RBRACKET},
    {"{", JOP_LBRACE},    {"}", JOP_RBRACE}, {",", JOP_COMMA},    {".", JOP_DOT},
    {":", JOP_COLON},     {"|", JOP_PIPE},   {"=", JOP_ASSIGN},   {"<", JOP_LT},
    {">", JOP_GT},
};

/* Is "{% [-+]? \s* NAME \s* ([-+]?%})" at P? Returns the end of the tag (after trim) or 0. */
static size_t match_tag_word(loom_jinja_lex_t *lx, size_t p, const char *word, char *sign_out,
                             bool trim_newline) {
    const char *s = lx->src;
    if (p + 2 > lx->len || s[p] != '{' || s[p + 1] != '%') return 0;
    p += 2;
    char sign = 0;
    if (p < lx->len && (s[p] == '-' || s[p] == '+')) sign = s[p++];
    while (p < lx->len && is_ws(s[p]))
        p++;
    size_t wl = strlen(word);
    if (p + wl > lx->len || memcmp(s + p, word, wl) != 0) return 0;
    p += wl;
    if (p < lx->len && (isalnum((unsigned char)s[p]) || s[p] == '_')) return 0;
    while (p < lx->len && is_ws(s[p]))
        p++;
    if (sign_out) *sign_out = sign;
    if (p + 3 <= lx->len && s[p] == '-' && s[p + 1] == '%' && s[p + 2] == '}') {
        p += 3;
        while (p < lx->len && is_ws(s[p]))
            p++;
        return p;
    }
    if (trim_newline && p + 3 <= lx->len && s[p] == '+' && s[p + 1] == '%' && s[p + 2] == '}')
        return p + 3;
    if (p + 2 <= lx->len && s[p] == '%' && s[p + 1] == '}') {
        p += 2;
        if (trim_newline && p < lx->len && s[p] == '\n') p++;
        return p;
    }
    return 0;
}

static loom_status_t lex_text_state(loom_jinja_lex_t *lx) {
    const char *s = lx->src;
    size_t a = lx->pos, p = a;
    int line = lx->line, col = lx->col;
    for (;;) {
        const char *q = memchr(s + p, '{', lx->len - p);
        if (!q || (size_t)(q - s) + 1 >= lx->len) {
            LOOM_CHECK(emit_text(lx, a, lx->len, 0, false, line, col));
            adv_to(lx, lx->len);
            return LOOM_OK;
        }
        p = (size_t)(q - s);
        char c = s[p + 1];
        if (c != '{' && c != '%' && c != '#') {
            p++;
            continue;
        }
        char sign = (p + 2 < lx->len && (s[p + 2] == '-' || s[p + 2] == '+')) ? s[p + 2] : 0;
        bool block = c != '{';
        if (c == '%') {
            char rs = 0;
            size_t body = match_tag_word(lx, p, "raw", &rs, false);
            if (body) {
                LOOM_CHECK(emit_text(lx, a, p, rs, true, line, col));
                adv_to(lx, body);
                int rline = lx->line, rcol = lx->col;
                /* find {% endraw %} */
                size_t e = body;
                size_t end = 0;
                char es = 0;
                for (; e + 1 < lx->len; e++)
                    if (s[e] == '{' && s[e + 1] == '%' &&
                        (end = match_tag_word(lx, e, "endraw", &es, true)))
                        break;
                if (!end) return lex_error(lx, rline, rcol, "missing endraw");
                lx->line_starting = false;
                LOOM_CHECK(emit_text(lx, body, e, es, true, rline, rcol));
                adv_to(lx, end);
                lx->line_starting = s[end - 1] == '\n';
                return LOOM_OK;
            }
        }
        LOOM_CHECK(emit_text(lx, a, p, sign, block, line, col));
        adv_to(lx, p);
        lx->line_starting = false;
        if (c == '#') {
            int cl = lx->line, cc = lx->col;
            const char *e = NULL;
            for (size_t k = p + 2; k + 1 < lx->len; k++)
                if (s[k] == '#' && s[k + 1] == '}') {
                    e = s + k;
                    break;
                }
            if (!e) return lex_error(lx, cl, cc, "unterminated comment");
            size_t k = (size_t)(e - s);
            size_t end = k + 2;
            if (k > p + 2 && s[k - 1] == '-') {
                while (end < lx->len && is_ws(s[end]))
                    end++;
            } else if (!(k > p + 2 && s[k - 1] == '+') && end < lx->len && s[end] == '\n') {
                end++;
            }
            adv_to(lx, end);
            lx->line_starting = s[end - 1] == '\n';
            return LOOM_OK;
        }
        loom_jinja_tok_t *t = push(lx, c == '{' ? JT_VAR_BEGIN : JT_BLOCK_BEGIN, lx->line, lx->col);
        if (!t) return LOOM_ERR_NOMEM;
        adv_to(lx, p + 2 + (sign ? 1 : 0));
        lx->in_tag = true;
        lx->tag_kind = t->kind;
        return LOOM_OK;
    }
}

static loom_status_t lex_tag_state(loom_jinja_lex_t *lx) {
    const char *s = lx->src;
    int depth = 0;
    bool after_dot = false;
    for (;;) {
        while (lx->pos < lx->len && is_ws(s[lx->pos]))
            adv_to(lx, lx->pos + 1);
        size_t p = lx->pos;
        if (p >= lx->len)
            return lex_error(lx, lx->line, lx->col,
                             lx->tag_kind == JT_VAR_BEGIN
                                 ? "unexpected end of template, expected '}}'"
                                 : "unexpected end of template, expected '%}'");
        int line = lx->line, col = lx->col;
        if (depth == 0) {
            char ec = lx->tag_kind == JT_VAR_BEGIN ? '}' : '%';
            size_t q = p;
            char sign = 0;
            if ((s[q] == '-' || s[q] == '+') && q + 2 < lx->len + 1 && q + 1 < lx->len &&
                s[q + 1] == ec)
                sign = s[q++];
            if (q + 1 < lx->len && s[q] == ec && s[q + 1] == '}' && (sign != '+' || ec == '%')) {
                size_t end = q + 2;
                if (sign == '-') {
                    while (end < lx->len && is_ws(s[end]))
                        end++;
                } else if (sign == 0 && ec == '%' && end < lx->len && s[end] == '\n') {
                    end++;
                }
                if (!push(lx, lx->tag_kind == JT_VAR_BEGIN ? JT_VAR_END : JT_BLOCK_END, line, col))
                    return LOOM_ERR_NOMEM;
                adv_to(lx, end);
                lx->line_starting = end > 0 && s[end - 1] == '\n';
                lx->in_tag = false;
                return LOOM_OK;
            }
        }
        loom_jinja_tok_t *t = push(lx, JT_NAME, line, col);
        if (!t) return LOOM_ERR_NOMEM;
        char c = s[p];
        if (isalpha((unsigned char)c) || c == '_') {
            size_t e = p;
            while (e < lx->len && (isalnum((unsigned char)s[e]) || s[e] == '_'))
                e++;
            t->s = s + p;
            t->len = e - p;
            adv_to(lx, e);
            after_dot = false;
            continue;
        }
        if (isdigit((unsigned char)c)) {
            LOOM_CHECK(lex_number(lx, t, after_dot));
            after_dot = false;
            continue;
        }
        if (c == '\'' || c == '"') {
            LOOM_CHECK(lex_string(lx, t));
            after_dot = false;
            continue;
        }
        int op = 0;
        size_t ol = 0;
        for (size_t k = 0; k < sizeof k_ops / sizeof k_ops[0]; k++) {
            size_t l = strlen(k_ops[k].s);
            if (p + l <= lx->len && memcmp(s + p, k_ops[k].s, l) == 0) {
                op = k_ops[k].op;
                ol = l;
                break;
            }
        }
        if (!op) {
            char msg[64];
            snprintf(msg, sizeof msg, "unexpected char '%c'", c);
            return lex_error(lx, line, col, msg);
        }
        if (op == JOP_LPAREN || op == JOP_LBRACKET || op == JOP_LBRACE) depth++;
        if ((op == JOP_RPAREN || op == JOP_RBRACKET || op == JOP_RBRACE) && depth > 0) depth--;
        t->kind = JT_OP;
        t->op = op;
        t->s = s + p;
        t->len = ol;
        after_dot = op == JOP_DOT;
        adv_to(lx, p + ol);
    }
}

loom_status_t loom_jinja_lex_all(loom_jinja_lex_t *lx) {
    lx->line = lx->col = 1;
    lx->line_starting = true;
    while (lx->pos < lx->len) {
        if (lx->in_tag)
            LOOM_CHECK(lex_tag_state(lx));
        else
            LOOM_CHECK(lex_text_state(lx));
    }
    if (lx->in_tag) return lex_error(lx, lx->line, lx->col, "unexpected end of template");
    if (!push(lx, JT_EOF, lx->line, lx->col)) return LOOM_ERR_NOMEM;
    return LOOM_OK;
}
